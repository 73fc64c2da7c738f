"""Where dataset rows come from: a dataset spec, parsed, then read.

Specs (`parse_dataset_spec(spec)`), tried in this order:
  * an existing local path:
      - `.jsonl` / `.json` / `.parquet` / `.csv` file: the whole file is the
        dataset (a single file has one split; `split` is ignored);
      - a `datasets` `save_to_disk` directory (a Dataset, or a DatasetDict
        from which `split` is taken);
      - any other directory: `load_dataset(dir, config, split=...)`, e.g. a
        local copy of a hub dataset repo: `path/to/gsm8k:main:test`.
  * `gsm8k:main[:split]`: alias for the hub dataset `openai/gsm8k`, config `main`.
  * `name[:config[:split]]`: a Hugging Face hub dataset id, loaded with
    `datasets.load_dataset(name, config, split=split)`. A split in the spec
    wins over the `split` argument.

JSON and JSON-lines files are read here, line by line, not by `datasets`: an
unparsable line is reported with the file and its line number (or skipped and
counted with --skip-bad-rows), and an empty file says so. Rows missing a key
that other rows have get None for it, as `datasets` would give.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areno.data import hub
from areno.errors import UserError, one_line

DATASET_ALIASES = {"gsm8k": "openai/gsm8k"}
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

# --------------------------------------------------------------------------
# dataset specs


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed dataset spec.

    kind: "file" (a local data file), "disk" (a save_to_disk directory),
          "dir" (another local directory, read by load_dataset), "hub".
    """

    kind: str
    name: str  # file/dir path or hub id
    config: str | None
    split: str

    def describe(self) -> str:
        if self.kind in ("file", "disk"):
            return self.name
        cfg = f", config '{self.config}'" if self.config else ""
        return f"'{self.name}'{cfg}, split '{self.split}'"


def _looks_like_path(s: str) -> bool:
    # Hub ids are `name` or `owner/name`; anything else with a slash is a path.
    return (
        Path(s).suffix.lower() in FILE_BUILDERS
        or s.startswith(("/", "./", "../", "~"))
        or s.count("/") > 1
    )


def _local_spec(p: Path, config: str | None, split: str, spec: str, flag: str) -> DatasetSpec:
    if p.is_dir():
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            if config:
                raise UserError(
                    f"{flag} {spec}: {p} is a save_to_disk directory, it takes no config "
                    f"(use '{p}' or '{p}::SPLIT')"
                )
            return DatasetSpec("disk", str(p), None, split)
        return DatasetSpec("dir", str(p), config, split)
    if config:
        raise UserError(f"{flag} {spec}: a local file takes no ':config' part")
    suffix = p.suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise UserError(
            f"{flag} {p}: unsupported file type '{suffix or '(none)'}'; "
            "use .jsonl, .json, .parquet, .csv or a save_to_disk directory"
        )
    return DatasetSpec("file", str(p), None, split)


def parse_dataset_spec(spec: str, split: str = "train", flag: str = "--dataset-path") -> DatasetSpec:
    """Parse a dataset spec (see the module docstring). Touches only the filesystem.
    flag: the option the spec came from, which a mistake names (--eval-dataset-path)."""
    s = str(spec).strip()
    if not s:
        raise UserError(f"{flag} is empty: pass a file, a directory or a hub id like gsm8k:main")
    whole = Path(s).expanduser()
    if whole.exists():
        return _local_spec(whole, None, split, s, flag)
    head, *rest = s.split(":")
    if len(rest) > 2 or not head:
        raise UserError(f"{flag} '{s}': expected NAME[:CONFIG[:SPLIT]] or a local path")
    config = (rest[0] or None) if rest else None
    if len(rest) == 2 and rest[1]:
        split = rest[1]
    local = Path(head).expanduser()
    if local.exists():
        return _local_spec(local, config, split, s, flag)
    if head in DATASET_ALIASES:
        return DatasetSpec("hub", DATASET_ALIASES[head], config, split)
    if _looks_like_path(head):
        raise UserError(f"{flag}: file not found: {head}")
    return DatasetSpec("hub", head, config, split)


def _load_dataset(ds: DatasetSpec) -> Any:
    """Load through `datasets`; every failure becomes a UserError naming the source."""
    import datasets

    # A missing id fails here; an unreachable hub switches to the cache at once.
    unreachable = hub.check_dataset_id(ds.name, ds.describe()) if ds.kind == "hub" else None
    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        if ds.kind == "file":
            return _load_file(ds.name)
        if ds.kind == "disk":
            obj = datasets.load_from_disk(ds.name)
            if isinstance(obj, datasets.DatasetDict):
                if ds.split not in obj:
                    raise UserError(
                        f"dataset {ds.name}: no split '{ds.split}'; it has {sorted(obj)}"
                    )
                return obj[ds.split]
            return obj
        return datasets.load_dataset(ds.name, ds.config, split=ds.split)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any loader failure is reported, not raised
        if ds.kind == "hub" and (unreachable is not None or hub.is_offline()):
            raise hub.dataset_fetch_error(ds.describe(), unreachable) from None
        if ds.kind == "hub":
            raise UserError(
                f"could not load dataset {ds.describe()} from the Hugging Face hub: "
                f"{one_line(e)}. Check the name, or download it and pass a local path "
                "(.jsonl/.json/.parquet/.csv file, save_to_disk directory, or a copy of the repo)"
            ) from None
        raise UserError(f"could not load dataset {ds.describe()}: {one_line(e)}") from None
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def _load_file(path: str) -> Any:
    """A .csv/.parquet file through `datasets`; a malformed one is one line naming the
    file and the parser's own words, which name the line (datasets wraps them in a
    DatasetGenerationError that says nothing, and logs them on stderr beforehand)."""
    import datasets

    builder = FILE_BUILDERS[Path(path).suffix.lower()]
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # we say it, once
    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    except datasets.exceptions.DatasetGenerationError as e:
        cause: BaseException = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        raise UserError(f"dataset {path}: not valid {builder.upper()}: {one_line(cause)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


# --------------------------------------------------------------------------
# reading


@dataclass
class RawRows:
    """Raw row dicts of a source, before normalization."""

    rows: list[dict]
    lines: list[int] | None = None  # 1-based file line of each row (JSON lines), else None
    bad_lines: list[str] = field(default_factory=list)  # "line N: why", skipped unparsable lines


def read_raw(ds: DatasetSpec, *, skip_bad_rows: bool = False) -> RawRows:
    """The raw rows of a parsed spec: JSON files read here, the rest through `datasets`."""
    if ds.kind == "file" and FILE_BUILDERS[Path(ds.name).suffix.lower()] == "json":
        return read_json_rows(Path(ds.name), skip_bad_rows=skip_bad_rows)
    if ds.kind == "file" and Path(ds.name).stat().st_size == 0:
        raise UserError(f"dataset {ds.name}: the file is empty")
    rows = _load_dataset(ds).to_list()
    if not rows:
        raise UserError(f"dataset {ds.describe()}: it has no rows")
    return RawRows(rows)


def read_json_rows(path: Path, *, skip_bad_rows: bool = False) -> RawRows:
    """A JSON array of objects, a .json object of equal-length columns, or one JSON
    object per line (blank lines ignored)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"could not load dataset {path}: {one_line(e)}") from None
    if not text.strip():
        raise UserError(f"dataset {path}: the file is empty (expected one JSON object per line)")
    whole = _whole_json(path, text)
    if whole is not None:
        if not whole:
            raise UserError(f"dataset {path}: no rows (the JSON array is empty)")
        return RawRows(_unify_keys(whole))
    raw = RawRows([], lines=[])
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problem = None if isinstance(row, dict) else \
                f"expected a JSON object of fields, got {type(row).__name__}"
        except json.JSONDecodeError as e:
            problem = f"not valid JSON: {e.msg} (column {e.colno})"
        if problem is None:
            raw.rows.append(row)
            raw.lines.append(n)
        elif skip_bad_rows:
            raw.bad_lines.append(f"line {n}: {problem}")
        else:
            raise UserError(f"dataset {path}: line {n}: {problem} (fix the line, or pass "
                            "--skip-bad-rows to skip and count it)")
    raw.rows = _unify_keys(raw.rows)
    return raw


def _whole_json(path: Path, text: str) -> list[dict] | None:
    """The rows of a .json file that is one JSON value (an array of objects, or an
    object of equal-length column lists); None for JSON lines (any .jsonl file)."""
    head = text.lstrip()[:1]
    if head not in ("[", "{") or path.suffix.lower() != ".json":
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if head == "{":
            return None  # one object per line: read line by line
        raise UserError(f"dataset {path}: line {e.lineno}: not valid JSON: {e.msg} "
                        f"(column {e.colno})") from None
    if isinstance(data, dict):
        cols = list(data.values())
        if not cols or not all(isinstance(c, list) and len(c) == len(cols[0]) for c in cols):
            return [data]  # a one-line file: one row
        data = [dict(zip(data, vals)) for vals in zip(*cols)]
    bad = [i for i, r in enumerate(data) if not isinstance(r, dict)]
    if bad:
        raise UserError(f"dataset {path}: element {bad[0]} of the JSON array is not an object "
                        f"of fields (got {type(data[bad[0]]).__name__})")
    return data


def _unify_keys(rows: list[dict]) -> list[dict]:
    """Every row gets every key any row has (None where missing), in first-seen order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [r if len(r) == len(keys) else {k: r.get(k) for k in keys} for r in rows]
