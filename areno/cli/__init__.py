"""`areno`'s entry point (`areno = areno.cli:main`, `python -m areno.cli`).

Kept to the standard library, so that the interrupt hold below starts before
anything heavy is imported: the app itself is areno/cli/app.py.
"""

from __future__ import annotations

import sys

from areno.procs.signals import held
from areno.timing import startup_mark


def main(argv: list[str] | None = None) -> int:
    """Run `areno ARGV` (default: sys.argv[1:]) -> its exit code."""
    startup_mark("main")
    with held():
        from areno.cli.app import run_app

        return run_app(argv)


if __name__ == "__main__":
    sys.exit(main())
