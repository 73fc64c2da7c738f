"""GPU check: attention kernels and the engine's peak memory (run by scripts/gpu_check.sh):
`python scripts/gpu_check.py --help`, or `python -m areno.bench.gpu_check`.
The code is areno/bench/gpu_check.py; areno must be importable (installed, or PYTHONPATH=.)."""

import sys

from areno.bench.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
