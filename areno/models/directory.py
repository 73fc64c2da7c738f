"""A local model directory (--ckpt) or checkpoint (--resume) checked before
anything loads it: config, tokenizer and weights present, and every
`*.safetensors` file as long as its header says.

Left to transformers, an empty directory is reported as a missing sentencepiece,
a config-only one as a tokenizer traceback, and a truncated `model.safetensors`
as a 100-line traceback from inside a rank. The header check costs one small read
per file: a safetensors file is an 8-byte little-endian header length, a JSON
header whose tensors declare `data_offsets` [begin, end) into the data that
follows, then the data; a copy cut short is shorter than the largest `end`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from areno.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.txt", "tokenizer.tiktoken")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
MODEL_DIR_FIX = ("pass a Hugging Face model directory (config.json, tokenizer files and "
                 "model.safetensors, as save_pretrained writes them) or a hub id")
MAX_HEADER = 100 << 20  # the format's own limit on the header's size


@dataclass(frozen=True)
class Weights:
    """What a model directory's weight files hold: element count and bytes on disk
    (None where a pytorch_model.bin cannot be counted without loading it). For a LoRA
    adapter directory: the adapter's."""

    params: int | None
    nbytes: int


def local_model_dir(model: str | Path) -> Path | None:
    """Where `model`'s files are on this host: the directory itself, or for a hub id
    (org/name) its snapshot in the HF cache (the revision `main` names); None when
    neither exists (nothing is downloaded here)."""
    d = Path(model).expanduser()
    if d.is_dir():
        return d
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(str(model), "config.json")
    except ValueError:  # not a valid hub id (HFValidationError is a ValueError)
        return None
    return Path(found).parent if isinstance(found, str) else None


def cached_weights(model: str) -> Weights | None:
    """What a hub id's snapshot in the HF cache holds, for estimates before anything
    is downloaded (shared memory, checkpoint room); None when it is not cached
    whole (the loaders fetch what is missing, and report a bad file themselves)."""
    d = local_model_dir(model)
    if d is None:
        return None
    try:
        return _check_weights(d, model, "")
    except UserError:
        return None


def check_model_dir(path: str | Path, flag: str, instead: str) -> Weights | None:
    """UserError naming `flag` and what is wrong with local model directory `path`
    (a hub id, not a directory, is left alone: None); instead: what to pass instead.
    Returns what its weights hold."""
    d = Path(path).expanduser()
    if not d.is_dir():
        return None
    where = f"{flag} {path}"
    if not any(d.iterdir()):
        raise UserError(f"{where}: the directory is empty; {instead}")
    if is_adapter_dir(d) and not (d / "config.json").is_file():  # a LoRA checkpoint
        return check_adapter_dir(d, flag, instead)
    if not (d / "config.json").is_file():
        raise UserError(f"{where}: no config.json (not a Hugging Face model directory); {instead}")
    _check_config(d / "config.json", where, instead)
    if not any((d / f).is_file() for f in TOKENIZER_FILES) and not list(d.glob("*.tiktoken")):
        raise UserError(f"{where}: no tokenizer files (tokenizer.json, tokenizer.model, "
                        f"vocab.json, ...); {instead}")
    return _check_weights(d, where, instead)


def _check_config(path: Path, where: str, instead: str) -> None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: config.json is not valid JSON ({' '.join(str(e).split())}); "
                        f"{instead}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"{where}: config.json names no model_type (not a transformers model "
                        f"config); {instead}")


def weight_files(d: Path, where: str, instead: str) -> list[Path]:
    """The weight files the directory's index names, or its single weight files."""
    for index in WEIGHT_INDEXES:
        if (d / index).is_file():
            try:
                names = sorted(set(json.loads((d / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError, TypeError):
                raise UserError(f"{where}: {index} is not a valid weight index; {instead}") from None
            missing = [n for n in names if not (d / n).is_file()]
            if missing:
                raise UserError(f"{where}: {index} names {missing[0]}, which is missing "
                                f"({len(missing)} of {len(names)} shards); {instead}")
            return [d / n for n in names]
    files = [d / f for f in SINGLE_WEIGHTS if (d / f).is_file()]
    files = files or sorted(d.glob("*.safetensors"))
    if not files:
        raise UserError(f"{where}: no weights (model.safetensors or pytorch_model.bin); {instead}")
    return files


def _check_weights(d: Path, where: str, instead: str) -> Weights:
    params: int | None = 0
    nbytes = 0
    for f in weight_files(d, where, instead):
        nbytes += f.stat().st_size
        if f.suffix == ".safetensors":
            n = safetensors_params(f, where, instead)
            params = None if params is None else params + n
        else:
            params = None
    return Weights(params, nbytes)


def safetensors_params(path: Path, where: str, instead: str) -> int:
    """Elements a safetensors file declares; UserError when it is shorter than its
    header says (a copy cut short) or the header is unreadable."""
    size = path.stat().st_size
    bad = f"{where}: {path.name} is truncated or not a safetensors file"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{bad} ({size} bytes); {instead}")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise UserError(f"{bad} (its header declares {n} bytes, the file has {size}); {instead}")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise UserError(f"{bad} (unreadable header); {instead}") from None
    tensors = [v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    end = max((int(t["data_offsets"][1]) for t in tensors), default=0)
    if 8 + n + end > size:
        raise UserError(f"{where}: {path.name} is truncated: its header declares "
                        f"{8 + n + end} bytes, the file has {size}; {instead}")
    return sum(math.prod(t["shape"]) for t in tensors)


# -- LoRA adapter directories (peft's save_pretrained layout) ---------------------
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_config(path: str | Path) -> dict | None:
    """A directory's adapter_config.json (a peft LoRA adapter), or None when it has none."""
    p = Path(path).expanduser() / ADAPTER_CONFIG
    if not p.is_file():
        return None
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError):
        cfg = None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: {ADAPTER_CONFIG} is not valid JSON")
    return cfg


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path, flag: str) -> str:
    """The base model an adapter directory was trained on (its base_model_name_or_path)."""
    base = (adapter_config(path) or {}).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise UserError(f"{flag} {path}: {ADAPTER_CONFIG} names no base_model_name_or_path")
    return base


def check_adapter_dir(path: str | Path, flag: str, instead: str) -> Weights:
    """UserError unless `path` is a whole LoRA adapter directory: adapter_config.json
    of a LoRA adapter, adapter_model.safetensors as long as its header says, and
    tokenizer files. Returns what the adapter's weights hold."""
    d = Path(path).expanduser()
    where = f"{flag} {path}"
    cfg = adapter_config(d) or {}
    if str(cfg.get("peft_type", "")).upper() != "LORA" or not cfg.get("r"):
        raise UserError(f"{where}: {ADAPTER_CONFIG} is not a LoRA adapter's (peft_type LORA, r > 0); "
                        f"{instead}")
    f = d / ADAPTER_WEIGHTS
    if not f.is_file():
        raise UserError(f"{where}: {ADAPTER_WEIGHTS} is missing; {instead}")
    if not any((d / t).is_file() for t in TOKENIZER_FILES):
        raise UserError(f"{where}: no tokenizer files beside the adapter; {instead}")
    return Weights(safetensors_params(f, where, instead), f.stat().st_size)
