"""The modes normlab's own writes give new files and folders: what open() and mkdir give them under
the process's umask. mkstemp and mkdtemp (atomic writes, a data folder built aside) make theirs
0600 / 0700 whatever the umask, and a run folder shared with colleagues (umask 022 or 002) would
hold results.json, run.json, test.hyp and checkpoints that only their owner can read (issue 37)."""
from __future__ import annotations

import os


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
