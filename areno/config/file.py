"""--config run.yaml -> flat option values: keys flat or nested under the help
groups (`rollout: {temperature: 0.8}`), each checked against TrainConfig (the
run directory's own config.yaml, a valid --config, is rundir/runconfig.py's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from areno.config.train import GROUPS, TrainConfig, field_type
from areno.errors import UserError
from areno.rundir.runconfig import RECORDED_PARAMS


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
