"""Which code trained a run, for its results.json (`code`) and so for every study record copied from
it: the normlab commit and whether its code or configs differed from it, torch and Python.

A run's identity (identity.py) is what it is asked to compute; the code and the thread count
(results.json `device`) are how. Either can move a result by a few ULPs (a reordered sum, a fused
op, another split of a matmul over threads), which deep post-LN amplifies into a different stall
step (benchmarks/README.md, the stalled arm's seed 1, whose record named neither): a record that
names both says what a rerun must use to be bit for bit the same. Read once per process, before
training (a `git` call at a signal or in a `finally` would be no place for it).
"""
from __future__ import annotations

import platform
import subprocess
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout, when normlab runs from one (src/normlab/..)


def _git(*args: str) -> str | None:
    try:
        # --no-optional-locks: a status here never takes .git/index.lock from the user's own git
        out = subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), *args], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@lru_cache(maxsize=1)
def code_version() -> dict:
    """{"commit": sha or None (not a git checkout, or git not there to ask), "dirty": src/ or conf/
    differ from it, new files there included (a new arm's yaml), None when unknown, "torch",
    "python"}. Not the installed package's version: with PYTHONPATH another tree's code runs."""
    import torch

    commit = _git("rev-parse", "HEAD") if (ROOT / ".git").exists() else None
    dirty = None
    if commit is not None:
        status = _git("status", "--porcelain", "--untracked-files=normal", "--", "src", "conf")
        dirty = bool(status) if status is not None else None
    return {"commit": commit, "dirty": dirty, "torch": torch.__version__, "python": platform.python_version()}


def code_legs(before: list[dict] | None, code: dict, from_step: int) -> list[dict]:
    """results.json `code_legs`: the earlier legs' (a checkpoint's), then this leg's commit and dirty
    flag from the step it started at. Earlier steps no record names (a checkpoint from before
    code_legs existed) are one leg of unknown code from step 0, so the legs always start at 0."""
    legs = list(before or [])
    if from_step > 0 and not legs:
        legs = [{"from_step": 0, "commit": None, "dirty": None}]
    return [*legs, {"from_step": from_step, "commit": code.get("commit"), "dirty": code.get("dirty")}]


def changed_since(commit: str) -> list[str] | None:
    """The files under src/ and conf/ of this checkout (its working tree, new files included) that
    differ from `commit`'s: [] when it runs that commit's code; None when the commit is not in this
    clone or git cannot say."""
    if not (ROOT / ".git").exists() or _git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return None
    changed = _git("diff", "--name-only", commit, "--", "src", "conf")
    new = _git("ls-files", "--others", "--exclude-standard", "--", "src", "conf")
    if changed is None or new is None:
        return None
    return sorted({line for line in (changed + "\n" + new).splitlines() if line.strip()})


def code_differs(a: str, b: str) -> list[str] | None:
    """The files under src/ and conf/ that differ between two commits ([]: the same code); None when
    git cannot say (a commit not in this clone)."""
    out = _git("diff", "--name-only", a, b, "--", "src", "conf") if (ROOT / ".git").exists() else None
    return None if out is None else [line for line in out.splitlines() if line.strip()]


def first_committed(path: Path) -> str | None:
    """The commit that first added `path` to this clone and its date ("abc12345 on 2026-11-25"):
    for a record that names no code, the newest code it can have trained at. Through renames of the
    file as it is (a study's folder moved), never through a similar file: records are alike, and
    git's usual 50% would follow one record added as another was deleted. None: not in git."""
    try:
        rel = Path(path).resolve().relative_to(ROOT)
    except ValueError:
        return None
    out = _git("log", "--follow", "-M100%", "--diff-filter=A", "--format=%h on %cs", "--abbrev=8", "--", str(rel))
    return out.splitlines()[-1] if out else None


def export_code(commit: str, dest: Path) -> bool:
    """src/ and conf/ as `commit` has them, written under `dest` (git archive): the code a record
    trained at, to run beside this checkout's. False when git cannot give them."""
    if not (ROOT / ".git").exists():
        return False
    try:
        archive = subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), "archive", "--format=tar", commit,
                                  "src", "conf"], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    if archive.returncode != 0:
        return False
    import io
    import tarfile

    Path(dest).mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        # git's own tree: plain files and folders (the "data" filter where this Python has it, 3.10.12+)
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return (Path(dest) / "src" / "normlab").is_dir() and (Path(dest) / "conf" / "config.yaml").is_file()
