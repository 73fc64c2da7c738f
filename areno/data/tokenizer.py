"""Loading a model directory's tokenizer: the one place, used by the controller
(run.py) and by an engine process's episode host (envs/driver.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areno.data.hub import check_model_id
from areno.errors import UserError
from areno.procs.signals import signals_held


# Classes AutoTokenizer resolves to themselves: loaded by name, they skip its
# import of transformers' auto machinery (torch and every model config: ~3 s).
PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def tokenizer_class(model_path: str) -> str | None:
    """tokenizer_config.json's tokenizer_class in a local model directory, else None."""
    try:
        return json.loads((Path(model_path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(model_path: str) -> Any:
    check_model_id(model_path)  # a hub id with no network: one line now, not a minute of retries
    with signals_held():  # seconds to import: a Ctrl-C lands after it, never inside (procs/signals.py)
        if tokenizer_class(model_path) in PLAIN_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast as Tokenizer
        else:
            from transformers import AutoTokenizer as Tokenizer
    try:
        return Tokenizer.from_pretrained(model_path)
    except OSError as e:
        raise UserError(f"--ckpt {model_path}: cannot load a tokenizer from it "
                        f"({' '.join(str(e).split())[:200]})") from None
