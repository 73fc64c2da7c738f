"""gpu_check.sh's CLI part: build the Qwen3-0.6B-shaped model, summarise a run:
`python scripts/gpu_check_cli.py --help`, or `PYTHONPATH=scripts python -m arenobench.gpu_check_cli`.
The code is scripts/arenobench/gpu_check_cli.py; areno must be importable (installed, or PYTHONPATH=.)."""

import sys

from arenobench.gpu_check_cli import main

if __name__ == "__main__":
    sys.exit(main())
