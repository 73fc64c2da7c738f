"""The asynchronous loop's benchmark (K = 0 vs K = 1 with fixed-cost stand-ins):
`python scripts/bench_async.py --help`, or `PYTHONPATH=scripts python -m arenobench.async_loop`.
The code is scripts/arenobench/async_loop.py; areno must be importable (installed, or PYTHONPATH=.)."""

import sys

from arenobench.async_loop import main

if __name__ == "__main__":
    sys.exit(main())
