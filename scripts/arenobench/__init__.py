"""The benchmarks' code: shared helpers (lib.py), the list-based reference
(listref.py), and each benchmark that tests or other code import. It lives in
scripts/, outside the installed package; the files in scripts/ are its entry
points (`python scripts/bench_x.py`, or `PYTHONPATH=scripts python -m
arenobench.x`); nothing in a training run imports this package."""
