"""The run directory's own config.yaml (RUN_CONFIG): every option of the run,
written at its start and read back (resume, the save path it recorded); written
and read here only. The file is a valid --config (config/file.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

RUN_CONFIG = "config.yaml"  # in the run directory: the run's options, a valid --config
RECORDED_PARAMS = "params"  # config.yaml: what the run measured (parameter counts), not an option


def write_run_config(run_dir: Path, options: dict[str, Any], params: dict | None = None) -> None:
    """RUN_DIR/config.yaml: every option (TrainConfig.to_dict()), plus the parameter
    counts under RECORDED_PARAMS (a key --config skips, so the file still works as one)."""
    with open(run_dir / RUN_CONFIG, "w") as f:
        yaml.safe_dump(options | ({RECORDED_PARAMS: params} if params else {}), f, sort_keys=False)


def read_run_config(run_dir: Path) -> dict[str, Any] | None:
    """RUN_DIR/config.yaml as written (None: missing, unreadable or not a mapping)."""
    try:
        saved = yaml.safe_load((run_dir / RUN_CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None
