"""Writing directories safely: the permissions the user's umask asks for, and
atomic replacement.

Permissions.

Some writers create files 0600 whatever the umask: transformers 5 writes
`model.safetensors` through a private temp file, and `tempfile.mkdtemp` makes
0700 directories. A checkpoint or a cached model is meant to be shared like any
other output (0644 / 0755 under the usual umask 022), so after writing one we
set every file to 0666 & ~umask and every directory to 0777 & ~umask.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it (Linux /proc), else by set-and-restore."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # the fallback briefly changes it (other threads may see 022)
    os.umask(mask)
    return mask


def honour_umask(root: str | os.PathLike) -> None:
    """chmod `root` and everything under it to the umask's modes (files keep +x if they
    had it). Symlinks are left alone."""
    mask = current_umask()
    root = Path(root)
    paths = [root] + list(root.rglob("*")) if root.is_dir() else [root]
    for p in paths:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111:
            mode = 0o777 & ~mask
        else:
            mode = 0o666 & ~mask
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(p, mode)


OLD_PREFIX = ".old-"  # a replaced directory on its way out: never listed as a checkpoint


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the complete directory tmp to final. An existing final (a re-save of
    the same step) is moved aside first and removed after, so a crash never leaves
    final missing for longer than two renames, and never half-written."""
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.with_name(f"{OLD_PREFIX}{final.name}-{os.getpid()}")
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final` if it holds a config.json; else `build(tmp)` into a temp dir beside it,
    made shareable (umask) and renamed into place, so concurrent builders never see
    or leave a half-written directory (a cached model). -> final."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        honour_umask(tmp)  # mkdtemp is 0700 and transformers writes safetensors 0600
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process won the race; its directory is complete.
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
