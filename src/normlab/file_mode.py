"""The modes normlab's own writes give new files and folders: what open() and mkdir give them under
the process's umask. mkstemp and mkdtemp (atomic writes, a data folder built aside) make theirs
0600 / 0700 whatever the umask, and a run folder shared with colleagues (umask 022 or 002) would
hold results.json, run.json, test.hyp and checkpoints that only their owner can read (issue 37)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def umask() -> int:
    """This process's umask, read without changing it (/proc, Linux 4.7+): os.umask can only set it,
    so reading it that way leaves it 0 for a moment, for every thread's new files."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # elsewhere: set and put back (0o077: a file made meanwhile is private, not open)
    os.umask(mask)
    return mask


def creation_mode(folder: bool = False) -> int:
    """The mode open() gives a new file (0o666) and mkdir a new folder (0o777) under the umask."""
    return (0o777 if folder else 0o666) & ~umask()


def atomic_write_bytes(path: str | os.PathLike, write) -> None:
    """Write through a temporary file in the same folder, then rename: readers see old or new. The
    file gets the mode a plain open() would give it (creation_mode), not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, creation_mode())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
