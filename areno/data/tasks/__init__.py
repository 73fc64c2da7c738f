"""Built-in tasks: a dataset and a reward plugin in one file each.

`--reward-fn-path builtin:NAME` names `areno/data/tasks/NAME.py`; the embedded demo
uses `arith`.
"""

from __future__ import annotations

from pathlib import Path

from areno.errors import UserError

TASKS_DIR = Path(__file__).resolve().parent


def resolve_plugin_path(spec: str) -> str:
    """'builtin:NAME' -> the task file's path; any other spec is returned as is."""
    if not spec.startswith("builtin:"):
        return spec
    name = spec.split(":", 1)[1]
    path = TASKS_DIR / f"{name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in TASKS_DIR.glob("*.py") if p.stem != "__init__")
        raise UserError(f"--reward-fn-path: no built-in task '{name}' (known: {', '.join(known)})")
    return str(path)
