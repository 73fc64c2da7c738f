"""Materialize benchmark: areno's array path against a list-based reference:
`python scripts/bench_materialize.py --help`, or `PYTHONPATH=scripts python -m arenobench.materialize`.
The code is scripts/arenobench/materialize.py; areno must be importable (installed, or PYTHONPATH=.)."""

import sys

from arenobench.materialize import main

if __name__ == "__main__":
    sys.exit(main())
