"""Dataset spec -> normalized rows (RowSet), once at startup.

    rows = load_rows("gsm8k:main")   # RowSet; prompts.py renders and tokenizes them

Dataset specs (`load_rows(spec)`: a local file or directory, `gsm8k:main`, a hub
id) are parsed and read in datasource.py. Everything per row here is O(rows)
Python done once; nothing on the per-step path.

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

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from areno.data.source import parse_dataset_spec, read_raw
from areno.errors import UserError, one_line, import_user_file, user_frame

DEFAULT_LOADER_FN = "load_row"
_MAX_REASONS = 5  # skip reasons kept for the log


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
                        i, None, f"loader_fn raised {one_line(e)}"
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
    flag: str = "--dataset-path",
) -> RowSet:
    """Load a dataset spec and normalize its rows (see the module docstring); flag:
    the option it came from, named by a mistake in the spec."""
    ds = parse_dataset_spec(spec, split, flag)
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
