"""GPU check: attention kernels and the engine's peak memory (run by scripts/gpu_check.sh):
`python scripts/gpu_check.py --help`, or `PYTHONPATH=scripts python -m arenobench.gpu_check`.
The code is scripts/arenobench/gpu_check.py; areno must be importable (installed, or PYTHONPATH=.)."""

import sys

from arenobench.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
