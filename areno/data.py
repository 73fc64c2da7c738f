"""Dataset spec -> rows -> rendered prompts -> flat token arrays.

    rows = load_rows("gsm8k:main")                          # RowSet
    prompts = tokenize_prompts(rows, tok, max_prompt_len=512)  # PromptSet (CSR)
    sampler = PromptSampler(len(prompts), batch_size=64, seed=0)
    ids, offsets = select(prompts, sampler.next_batch())

Everything per row (loading, normalizing, rendering) is O(rows) Python done
once at startup; the per-step path (`PromptSampler.next_batch`, `select`) is
a few vectorized numpy calls, with no per-token Python.

Dataset specs (`load_rows(spec)`: a local file or directory, `gsm8k:main`, a hub
id) are parsed and read in datasource.py.

Row normalization. Every row becomes a dict with at least
  `prompt`    str, or a list of chat messages {"role": str, "content": str}
  `answer`    str or None (the reference final answer, if any)
  `solutions` list[str] or None (reference solutions, if any)
plus every other field the row (or the loader) has. Without a loader:
  * a row with `prompt` keeps it (and its `answer` / `solutions` if present);
  * else a GSM8K-style row with `question` gets prompt = question, and its
    `answer` becomes the text after the last `####`, stripped, commas removed
    (the whole answer, stripped, if it has no `####`);
  * a number in `answer` becomes its string.
With `loader_fn="path/to/file.py[:fn]"` (fn defaults to `load_row`), fn(raw
row dict) -> normalized dict is applied to each row; returning None drops the
row on purpose (counted in `RowSet.filtered`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from areno.datasource import DatasetSpec, parse_dataset_spec, read_raw  # noqa: F401 - re-exported
from areno.errors import UserError, _one_line, import_user_file, user_frame
from areno.rollout.batch import offsets_from_lengths

DEFAULT_LOADER_FN = "load_row"
_MAX_REASONS = 5  # skip reasons kept for the log

# --------------------------------------------------------------------------
# rows


@dataclass(repr=False)
class RowSet:
    """Normalized rows (see the module docstring for the row contract)."""

    rows: list[dict]
    source: str  # where they came from, for messages
    num_raw: int  # rows read before dropping any
    skipped: int = 0  # malformed rows dropped (skip_bad_rows=True)
    filtered: int = 0  # rows the loader_fn dropped on purpose (returned None)
    skip_reasons: list[str] = field(default_factory=list)  # the first few

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def __repr__(self) -> str:
        return (
            f"RowSet({len(self.rows)} rows from {self.source}, read {self.num_raw}, "
            f"skipped {self.skipped}, filtered {self.filtered})"
        )


def gsm8k_final_answer(text: str) -> str:
    """The final answer of a GSM8K solution: text after the last '####', commas removed."""
    tail = text.rsplit("####", 1)[-1]
    return tail.strip().replace(",", "")


def load_loader_fn(spec: str) -> Callable[[dict], dict | None]:
    """`path/to/file.py[:fn]` -> the function (default name `load_row`)."""
    path, _, name = str(spec).partition(":")
    name = name or DEFAULT_LOADER_FN
    module = import_user_file(path, what="--dataset-loader-fn file")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"--dataset-loader-fn {path}: defines no function '{name}' (expected {name}(row) -> dict)")
    return fn


def _default_row(row: dict, i: int) -> dict:
    if "prompt" in row:
        return dict(row)
    if "question" in row:
        out = dict(row)
        out["prompt"] = row["question"]
        if isinstance(row.get("answer"), str):
            out["answer"] = gsm8k_final_answer(row["answer"])
        return out
    raise _RowError(
        i, "prompt", f"missing (no 'prompt' or 'question' column; columns: {sorted(row)}); "
        "pass --dataset-loader-fn to map your columns"
    )


class _RowError(Exception):
    def __init__(self, index: int, fieldname: str | None, problem: str) -> None:
        where = f"row {index}: field '{fieldname}'" if fieldname else f"row {index}:"
        super().__init__(f"{where} {problem}")


def _check_prompt(prompt: Any, i: int) -> None:
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise _RowError(i, "prompt", f"must be a string or a non-empty list of chat messages, got {type(prompt).__name__}")
    for j, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise _RowError(i, f"prompt[{j}]", f"must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise _RowError(i, f"prompt[{j}].{key}", f"must be a string, got {type(m.get(key)).__name__}")


def _check_row(out: Any, i: int) -> dict:
    """Validate one normalized row; fill `answer`/`solutions` defaults."""
    if not isinstance(out, dict):
        raise _RowError(i, "prompt", f"missing: loader_fn returned {type(out).__name__}, expected a dict")
    if "prompt" not in out:
        raise _RowError(i, "prompt", f"missing (fields: {sorted(out)})")
    _check_prompt(out["prompt"], i)
    answer = out.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        out["answer"] = str(answer)
    elif answer is not None and not isinstance(answer, str):
        raise _RowError(i, "answer", f"must be a string, got {type(answer).__name__}")
    else:
        out["answer"] = answer
    sols = out.get("solutions")
    if sols is not None:
        if not isinstance(sols, (list, tuple)) or not all(isinstance(s, str) for s in sols):
            raise _RowError(i, "solutions", "must be a list of strings")
        out["solutions"] = list(sols)
    else:
        out["solutions"] = None
    return out


def normalize_rows(
    raw: Sequence[dict],
    *,
    loader_fn: Callable[[dict], dict | None] | None = None,
    loader_path: str = "",
    skip_bad_rows: bool = False,
    source: str = "",
    lines: Sequence[int] | None = None,
    bad_lines: Sequence[str] = (),
) -> RowSet:
    """Normalize raw row dicts (O(rows) Python, once). A malformed row raises a
    UserError naming the row index (and its file line, given `lines`) and field,
    or is skipped and counted. bad_lines: unparsable lines the reader skipped,
    counted as skipped rows."""
    rows: list[dict] = []
    rs = RowSet(rows=rows, source=source, num_raw=len(raw) + len(bad_lines),
                skipped=len(bad_lines), skip_reasons=list(bad_lines[:_MAX_REASONS]))
    for i, row in enumerate(raw):
        try:
            if loader_fn is None:
                out = _default_row(row, i)
            else:
                try:
                    out = loader_fn(dict(row))
                except Exception as e:  # noqa: BLE001 - the user's code failed on this row
                    raise _RowError(
                        i, None, f"loader_fn raised {_one_line(e)}"
                        f"{user_frame(e, loader_path) if loader_path else ''}"
                    ) from None
                if out is None:
                    rs.filtered += 1
                    continue
            rows.append(_check_row(out, i))
        except _RowError as e:
            line = f"line {lines[i]}; " if lines is not None else ""
            if not skip_bad_rows:
                raise UserError(f"dataset {source}: {e} ({line}fix the row, or pass "
                                "--skip-bad-rows)") from None
            rs.skipped += 1
            if len(rs.skip_reasons) < _MAX_REASONS:
                rs.skip_reasons.append(f"{e} ({line[:-2]})" if line else str(e))
    if not rows:
        raise UserError(
            f"dataset {source}: no usable rows ({rs.num_raw} read, {rs.skipped} malformed, "
            f"{rs.filtered} dropped by the loader)"
            + (f"; first problem: {rs.skip_reasons[0]}" if rs.skip_reasons else "")
        )
    return rs


def load_rows(
    spec: str,
    *,
    split: str = "train",
    loader_fn: str | None = None,
    skip_bad_rows: bool = False,
) -> RowSet:
    """Load a dataset spec and normalize its rows (see the module docstring)."""
    ds = parse_dataset_spec(spec, split)
    fn = load_loader_fn(loader_fn) if loader_fn else None  # fail before loading data
    raw = read_raw(ds, skip_bad_rows=skip_bad_rows)
    return normalize_rows(
        raw.rows,
        loader_fn=fn,
        loader_path=str(loader_fn).partition(":")[0] if loader_fn else "",
        skip_bad_rows=skip_bad_rows,
        source=ds.describe(),
        lines=raw.lines,
        bad_lines=raw.bad_lines,
    )


# --------------------------------------------------------------------------
# prompts


@dataclass(frozen=True, repr=False)
class PromptSet:
    """Rendered, tokenized prompts in CSR layout.

    ids:        [sum lens] int32, every prompt's tokens concatenated
    offsets:    [P+1] int64, prompt p is ids[offsets[p]:offsets[p+1]]
    row_index:  [P] int64, the RowSet row prompt p came from
    texts:      P rendered prompt strings (what the model sees)
    """

    ids: np.ndarray
    offsets: np.ndarray
    row_index: np.ndarray
    texts: list[str]
    max_prompt_len: int
    dropped_overlong: int = 0  # prompts longer than max_prompt_len tokens
    dropped_empty: int = 0  # prompts that rendered to zero tokens

    def __post_init__(self) -> None:
        assert self.ids.dtype == np.int32 and self.offsets.dtype == np.int64, (self.ids.dtype, self.offsets.dtype)
        assert self.offsets[-1] == self.ids.size and self.row_index.size == len(self.texts) == self.offsets.size - 1

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __repr__(self) -> str:
        return (
            f"PromptSet({len(self)} prompts, {self.ids.size} tokens, max_prompt_len="
            f"{self.max_prompt_len}, dropped_overlong={self.dropped_overlong}, "
            f"dropped_empty={self.dropped_empty})"
        )

    @property
    def lengths(self) -> np.ndarray:
        """[P] int64"""
        return np.diff(self.offsets)


def _conversation(prompt: Any, system_prompt: str | None) -> list[dict]:
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and msgs[0].get("role") != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


def render_prompts(
    rows: Sequence[dict],
    tokenizer: Any,
    *,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> list[str]:
    """Each row's prompt as the text the model sees.

    Chat template: a string prompt becomes one user message; `system_prompt`
    is prepended unless the messages already start with a system message; the
    assistant turn is opened (add_generation_prompt=True). Plain text: the
    prompt string as is, after `system_prompt` and a blank line if given.
    """
    if use_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                "the tokenizer has no chat template: pass --no-chat-template for "
                "plain-text prompts, or use a tokenizer that has one"
            )
        convs = [_conversation(r["prompt"], system_prompt) for r in rows]
        try:
            return list(tokenizer.apply_chat_template(convs, tokenize=False, add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - find the row that broke the template
            for i, conv in enumerate(convs):
                try:
                    tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
                except Exception as e:  # noqa: BLE001
                    raise UserError(f"row {i}: field 'prompt': the chat template failed on it: {_one_line(e)}") from None
            raise
    texts = []
    for i, r in enumerate(rows):
        if not isinstance(r["prompt"], str):
            raise UserError(
                f"row {i}: field 'prompt' is a list of chat messages but --no-chat-template is set"
            )
        texts.append(f"{system_prompt}\n\n{r['prompt']}" if system_prompt else r["prompt"])
    return texts


def tokenize_prompts(
    rows: Sequence[dict],
    tokenizer: Any,
    *,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    max_prompt_len: int,
) -> PromptSet:
    """Render every prompt, tokenize them in one batched call, store them flat.

    Prompts with more than `max_prompt_len` tokens, or none, are dropped and
    counted; a UserError if none is left. A chat-rendered prompt is tokenized
    without adding special tokens (the template holds them); plain text gets the
    tokenizer's usual special tokens (e.g. BOS).
    """
    if max_prompt_len < 1:
        raise UserError(f"--max-prompt-len must be >= 1, got {max_prompt_len}")
    texts = render_prompts(rows, tokenizer, use_chat_template=use_chat_template, system_prompt=system_prompt)
    enc = tokenizer(texts, add_special_tokens=not use_chat_template)["input_ids"]
    lengths = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))
    flat = np.fromiter(itertools.chain.from_iterable(enc), dtype=np.int32, count=int(lengths.sum()))
    empty = lengths == 0
    overlong = lengths > max_prompt_len
    keep = ~(empty | overlong)
    if not keep.any():
        raise UserError(
            f"no prompt fits --max-prompt-len={max_prompt_len}: {int(overlong.sum())} of "
            f"{lengths.size} prompts are longer (shortest {int(lengths[~empty].min()) if (~empty).any() else 0} tokens), "
            f"{int(empty.sum())} are empty; raise --max-prompt-len"
        )
    kept = np.flatnonzero(keep)
    return PromptSet(
        ids=flat[np.repeat(keep, lengths)],
        offsets=offsets_from_lengths(lengths[keep]),
        row_index=kept.astype(np.int64),
        texts=[texts[i] for i in kept],
        max_prompt_len=int(max_prompt_len),
        dropped_overlong=int(overlong.sum()),
        dropped_empty=int(empty.sum()),
    )


def select(prompt_set: PromptSet, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat tokens of prompts `idx` ([B] int): ([sum lens] int32, [B+1] int64).

    One vectorized gather: token j of the output comes from
    ids[start[b] + (j - new_offsets[b])] for the prompt b it belongs to.
    """
    idx = np.asarray(idx, dtype=np.int64)
    starts = prompt_set.offsets[idx]
    lengths = prompt_set.offsets[idx + 1] - starts
    offsets = offsets_from_lengths(lengths)
    src = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    return prompt_set.ids[src], offsets


# --------------------------------------------------------------------------
# sampling


class PromptSampler:
    """Deterministic shuffled batches of prompt indices, epoch after epoch.

    Epoch e visits the prompts in the order `default_rng([seed, e]).permutation(P)`
    in batches of `batch_size` prompts. A batch never spans two epochs: the last
    P % batch_size prompts of each epoch's order are dropped (they are in other
    positions, and so used, in other epochs). This keeps a prompt from
    appearing twice in one batch. `state_dict()` / `load_state_dict()` resume
    the exact same order.
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise UserError(f"prompt batch size must be >= 1, got {batch_size}")
        if batch_size > num_prompts:
            raise UserError(
                f"prompt batch size {batch_size} is larger than the dataset's {num_prompts} "
                "usable prompts; lower the batch size or use more data"
            )
        self.num_prompts = int(num_prompts)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next batch's first prompt
        self._order: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_prompts // self.batch_size

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = rng.permutation(self.num_prompts).astype(np.int64)
        return self._order

    def next_batch(self) -> np.ndarray:
        """[batch_size] int64 prompt indices."""
        if self.position + self.batch_size > self.num_prompts:
            self.epoch += 1
            self.position = 0
            self._order = None
        out = self._epoch_order()[self.position : self.position + self.batch_size].copy()
        self.position += self.batch_size
        return out

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` left off (its seed wins; the batch size may change)."""
        if int(state["num_prompts"]) != self.num_prompts:
            raise UserError(
                f"resume: the dataset now has {self.num_prompts} usable prompts but the "
                f"checkpoint was sampling from {state['num_prompts']}; resume with the same data"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None
