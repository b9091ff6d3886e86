"""provenance.code_version: the commit that trained a run and whether src/ or conf/ differed from it
(new files there included; elsewhere not), None where it cannot be known (no checkout, no git), and
asking git never writes the user's index (git --no-optional-locks)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from normlab import provenance

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A git checkout with src/, conf/ and a README, committed; code_version reads it, uncached."""
    for rel in ("src/normlab/a.py", "conf/config.yaml", "README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    provenance.code_version.cache_clear()
    yield tmp_path
    provenance.code_version.cache_clear()


def version():
    provenance.code_version.cache_clear()
    return provenance.code_version()


def test_a_clean_checkout_names_its_commit(checkout):
    import platform

    import torch

    v = version()
    assert v == {"commit": git(checkout, "rev-parse", "HEAD"), "dirty": False, "torch": torch.__version__,
                 "python": platform.python_version()}
    assert len(v["commit"]) == 40


@pytest.mark.parametrize("change, dirty", [
    (lambda r: (r / "src/normlab/a.py").write_text("x = 2\n"), True),      # code edited
    (lambda r: (r / "conf/arm.yaml").write_text("a: 1\n"), True),           # a new, untracked config
    (lambda r: (r / "src/normlab/a.py").unlink(), True),                    # code removed
    (lambda r: (r / "README.md").write_text("other\n"), False),             # outside src/ and conf/
    (lambda r: (r / "notes.txt").write_text("n\n"), False),                 # a new file elsewhere
])
def test_dirty_means_src_or_conf_differ(checkout, change, dirty):
    change(checkout)
    assert version()["dirty"] is dirty


def test_no_checkout_and_no_git_are_unknown(checkout, monkeypatch):
    shutil.rmtree(checkout / ".git")
    assert version()["commit"] is None and version()["dirty"] is None

    git(checkout, "init", "-q")  # a checkout again, but git cannot be started
    monkeypatch.setattr(provenance.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no git")))
    v = version()
    assert v["commit"] is None and v["dirty"] is None


def test_asking_git_never_writes_the_index(checkout):
    """A tracked file touched (same bytes, new mtime) makes a plain `git status` refresh and rewrite
    .git/index (taking index.lock, which fails a user's git running at that moment); with
    --no-optional-locks it stays as it was."""
    index = checkout / ".git" / "index"
    before = (index.read_bytes(), index.stat().st_mtime_ns)
    t = os.stat(checkout / "src/normlab/a.py").st_mtime + 100
    os.utime(checkout / "src/normlab/a.py", (t, t))
    assert version()["dirty"] is False
    assert (index.read_bytes(), index.stat().st_mtime_ns) == before
