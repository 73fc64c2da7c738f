"""gpu_check.sh's CLI part: build the Qwen3-0.6B-shaped model, summarise a run:
`python scripts/gpu_check_cli.py --help`, or `python -m areno.bench.gpu_check_cli`.
The code is areno/bench/gpu_check_cli.py; areno must be importable (installed, or PYTHONPATH=.)."""

import sys

from areno.bench.gpu_check_cli import main

if __name__ == "__main__":
    sys.exit(main())
