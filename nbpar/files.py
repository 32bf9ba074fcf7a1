"""Writing files so a crash leaves the old file or the whole new one, never half.

Pure Python, at the bottom of the package: checkpoints and prepared data sets use it.
"""

from __future__ import annotations

import contextlib
import os


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str):
    """Yield a temp path beside ``path`` to write; on success it is fsynced and renamed
    onto ``path`` (readers see the old file or the whole new one, never half of it)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)
