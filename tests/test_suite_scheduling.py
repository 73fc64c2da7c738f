"""The suite's own scheduling under pytest-xdist (tests/conftest.py): a module
whose tests share a module-scoped fixture (a trained run, an engine) must go to
one worker, or each worker builds it (test_resume's 4-step run: 28 s twice).
conftest does it by adding `xdist_group` marks at collection, which
`--dist loadgroup` honours only where xdist's node-id suffix takes effect:
pytest 9.2 silently ignores it (pytest-xdist#1386), hence pyproject's pin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFTEST = '''
import pytest

@pytest.hookimpl(tryfirst=True)  # as tests/conftest.py adds them: before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    for it in items:
        it.add_marker(pytest.mark.xdist_group(it.nodeid.split("::")[0]))
'''

MODULE = '''
import os
import time

def _log(name):
    time.sleep(0.3)  # long enough that an idle worker would take the next test
    with open("workers.txt", "a") as f:
        f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")

''' + "".join(f"def test_{i}():\n    _log('{i}')\n\n" for i in range(4))


def test_a_collection_time_xdist_group_keeps_a_module_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_shared.py").write_text(MODULE)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                          "-p", "no:cacheprovider", "test_shared.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    workers = dict(line.split() for line in (tmp_path / "workers.txt").read_text().splitlines())
    assert len(workers) == 4 and len(set(workers.values())) == 1, f"one module on several workers: {workers}"
