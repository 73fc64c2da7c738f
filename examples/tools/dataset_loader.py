"""GSM8K rows for the calculator environment (--dataset-loader-fn): the math
example's rows (examples/math/dataset_loader.py) with an instruction on the tool."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "areno_math_dataset_loader", Path(__file__).resolve().parent.parent / "math" / "dataset_loader.py")
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

TOOL = ("You have a calculator: write an expression as <calc>3*(4+5)</calc> and stop; "
        "its value comes back as <result>27</result>. Use it for any arithmetic.")


def load_row(row: dict) -> dict:
    out = _base.load_row(row)
    out["prompt"] = f"{out['prompt']}\n\n{TOOL}"
    return out
