"""Hugging Face hub ids when the hub cannot be reached: know in a second.

Left alone, transformers and datasets retry an unreachable hub for most of a
minute and then report the last file they tried (a tokenizer file, cut
mid-URL). Before any of that, one metadata request with a short timeout tells
three cases apart:

  found        the loaders take over as usual;
  missing      the id does not exist (or is private / gated): one line saying so;
  unreachable  no network: use the local HF cache if it has the repo (the whole
               process and those it starts switch to HF_HUB_OFFLINE), else one
               line saying how to use a local copy.

With HF_HUB_OFFLINE already set nothing is requested: a model must be in the
cache, a dataset is left to `datasets` (which fails at once when offline).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from areno.errors import UserError, one_line

PROBE_TIMEOUT_S = 5.0  # one metadata request; the hub answers in well under a second
RepoType = Literal["model", "dataset"]


@dataclass(frozen=True)
class HubStatus:
    state: Literal["found", "missing", "unreachable"]
    detail: str = ""  # why, for "unreachable": the connection error, one line


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def go_offline() -> None:
    """Read the HF cache only, in this process and in the ones it starts (env)."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    ds_config = sys.modules.get("datasets.config")
    if ds_config is not None:  # datasets copies the flag at import
        ds_config.HF_HUB_OFFLINE = ds_config.HF_DATASETS_OFFLINE = True


def hub_status(repo_id: str, repo_type: RepoType) -> HubStatus:
    """Ask the hub (one request, PROBE_TIMEOUT_S) whether `repo_id` exists."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=PROBE_TIMEOUT_S)
    except GatedRepoError:
        return HubStatus("found")  # it exists; the loaders say what access it needs
    except (RepositoryNotFoundError, HFValidationError) as e:
        return HubStatus("missing", one_line(e, 160))
    except Exception as e:  # noqa: BLE001 - DNS, refused, timeout, proxy, 5xx: all "cannot reach"
        return HubStatus("unreachable", one_line(e, 160))
    return HubStatus("found")


def in_cache(repo_id: str, filename: str, repo_type: RepoType) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename, repo_type=repo_type), str)
    except Exception:  # noqa: BLE001 - a malformed id is simply not cached
        return False


def check_model_id(ckpt: str, flag: str = "--ckpt") -> None:
    """Make sure a --ckpt that is not a local directory can be loaded, fast."""
    if Path(ckpt).expanduser().exists():
        return
    cached = in_cache(ckpt, "config.json", "model")
    local = (f"pass a local model directory instead (`hf download {ckpt} --local-dir DIR` "
             f"on a machine with network, then {flag} DIR)")
    if is_offline():
        if not cached:
            raise UserError(f"{flag} {ckpt}: not a local directory, and not in the Hugging Face "
                            f"cache while HF_HUB_OFFLINE is set; {local}")
        return
    status = hub_status(ckpt, "model")
    if status.state == "missing":
        raise UserError(f"{flag} {ckpt}: not a local directory, and no such model on the Hugging "
                        "Face hub (or it is private: log in with `hf auth login`); check the id, "
                        f"or {local}")
    if status.state == "unreachable":
        if cached:
            go_offline()
            print(f"areno: the Hugging Face hub is unreachable; using the cached copy of {ckpt}",
                  file=sys.stderr)
            return
        raise UserError(f"{flag} {ckpt}: not a local directory, and could not be fetched from "
                        f"the Hugging Face hub (no network? {status.detail}) nor found in the local "
                        f"cache; {local}, or set HF_HUB_OFFLINE=1 with the model in the HF cache")


def check_dataset_id(repo_id: str, described: str) -> str | None:
    """Before `datasets.load_dataset(repo_id)`: a missing id is a UserError; with no
    network, go offline so `datasets` reads its cache at once instead of retrying.
    Returns why the hub is unreachable (for the message if the cache fails too), else
    None. described: the dataset as messages name it."""
    if is_offline():
        return None
    status = hub_status(repo_id, "dataset")
    if status.state == "missing":
        raise UserError(f"no dataset {described} on the Hugging Face hub (or it is private: log "
                        "in with `hf auth login`); check the name, or pass a local "
                        ".jsonl/.json/.parquet/.csv file or save_to_disk directory")
    if status.state == "unreachable":
        go_offline()
        return status.detail
    return None


def dataset_fetch_error(described: str, unreachable: str | None) -> UserError:
    """The one line for a hub dataset that is neither reachable nor cached."""
    why = f"no network? {unreachable}" if unreachable is not None else "HF_HUB_OFFLINE is set"
    return UserError(f"could not fetch dataset {described} from the Hugging Face hub ({why}) and "
                     "it is not in the local cache; download it on a machine with network and "
                     "pass a local .jsonl/.json/.parquet/.csv file or save_to_disk directory, or "
                     "set HF_HUB_OFFLINE=1 with it in the HF cache")
