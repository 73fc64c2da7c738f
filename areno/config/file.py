"""--config run.yaml -> flat option values: keys flat or nested under the help
groups (`rollout: {temperature: 0.8}`), each checked against TrainConfig; and
the run directory's own config.yaml (RUN_CONFIG), written and read here only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from areno.config.train import GROUPS, TrainConfig, field_type
from areno.errors import UserError


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


def read_config_file(path: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--config: file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"--config {path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of option: value")
    fields = {f.name: f for f in TrainConfig.fields()}
    groups = {g.lower().replace(" ", "_"): g for g in GROUPS}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k in fields:
            flat[k] = value
        elif k == RECORDED_PARAMS and k not in fields:  # a run's config.yaml read back as --config
            continue
        elif k.lower() in groups and isinstance(value, dict):
            for sub, v in value.items():
                s = str(sub).replace("-", "_")
                if s not in fields:
                    raise UserError(f"--config {path}: unknown option '{sub}' under '{key}'")
                right = fields[s].metadata["group"]
                if right != groups[k.lower()]:
                    raise UserError(f"--config {path}: '{sub}' is not a {groups[k.lower()]} option; "
                                    f"move it under '{right.lower().replace(' ', '_')}' (or to "
                                    "the top level)")
                flat[s] = v
        else:
            raise UserError(f"--config {path}: unknown option '{key}'")
    return {k: _yaml_number(k, v) for k, v in flat.items()}


def _yaml_number(name: str, value: Any) -> Any:
    """A float option's YAML string that is a number, as that number: PyYAML follows
    YAML 1.1, which reads `1e-5` (no dot) as a string, while `1.0e-5` is a float."""
    if field_type(name) is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # not a number: fieldcheck names the option
    return value
