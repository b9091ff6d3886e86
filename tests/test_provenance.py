"""provenance.code_version: the commit that trained a run and whether src/ or conf/ differed from it
(new files there included; elsewhere not), None where it cannot be known (no checkout, no git), and
asking git never writes the user's index (git --no-optional-locks)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

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


def test_no_git_and_no_checkout_are_unknown(checkout, monkeypatch):
    with monkeypatch.context() as m:  # the committed checkout, but git cannot be started
        m.setattr(provenance.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no git")))
        v = version()
        assert v["commit"] is None and v["dirty"] is None
    assert version()["commit"] is not None  # the same checkout with git: known
    shutil.rmtree(checkout / ".git")
    assert version()["commit"] is None and version()["dirty"] is None


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


def test_code_legs_start_at_step_0_and_keep_the_earlier_legs():
    a = {"from_step": 0, "commit": "a" * 40, "dirty": False}
    code = {"commit": "b" * 40, "dirty": True, "torch": "t", "python": "p"}
    b = lambda step: {"from_step": step, "commit": "b" * 40, "dirty": True}  # noqa: E731
    unknown = {"from_step": 0, "commit": None, "dirty": None}
    assert provenance.code_legs(None, code, 0) == [b(0)]
    assert provenance.code_legs([a], code, 13) == [a, b(13)]
    assert provenance.code_legs([], code, 13) == [unknown, b(13)]  # steps no record names


@pytest.mark.parametrize("saved, legs_before", [
    ({"code_legs": [{"from_step": 0, "commit": "a" * 40, "dirty": False}]},
     [{"from_step": 0, "commit": "a" * 40, "dirty": False}]),
    ({}, [{"from_step": 0, "commit": None, "dirty": None}]),   # a full checkpoint from before code_legs
    (None, [{"from_step": 0, "commit": None, "dirty": None}]),  # a checkpoint from before full-state ones
])
def test_a_continued_leg_starts_at_its_checkpoints_step_even_without_training(saved, legs_before):
    """The leg's start is the checkpoint's step as soon as it is loaded: Lightning skips
    on_train_start when the checkpoint is at max_steps (a run killed while scoring, rerun), and
    that leg must not read as a second leg from step 0."""
    from types import SimpleNamespace

    from normlab.callbacks.full_checkpoint import FullStateCheckpoint

    cb = FullStateCheckpoint(every_n_steps=5)
    cb.code = {"commit": "b" * 40, "dirty": False}
    checkpoint = {"global_step": 2000, "callbacks": {}}
    if saved is not None:
        checkpoint["normlab"] = {"rng": [{}], "train_tokens": 1.0, "train_seconds": 1.0, "wall_s": 5.0, **saved}
    module = SimpleNamespace(restore_throughput_counters=lambda *a: None)
    cb.on_load_checkpoint(SimpleNamespace(global_rank=0), module, checkpoint)
    assert cb.code_legs() == [*legs_before, {"from_step": 2000, "commit": "b" * 40, "dirty": False}]


def test_legs_of_a_run_without_the_full_checkpoint_callback():
    """train._code_legs without FullStateCheckpoint: resume= takes the legs of the checkpoint's
    run and starts at its step; finetune= (no start state) is one leg from 0; the folder's own
    checkpoint continues at its step; a rank other than 0 (no code) writes none."""
    from types import SimpleNamespace

    from normlab.train import _code_legs

    code = {"commit": "b" * 40, "dirty": False}
    a = {"from_step": 0, "commit": "a" * 40, "dirty": False}
    b = lambda step: {"from_step": step, "commit": "b" * 40, "dirty": False}  # noqa: E731
    unknown = {"from_step": 0, "commit": None, "dirty": None}
    fresh, own = SimpleNamespace(checkpoint=None, step=0), SimpleNamespace(checkpoint="full-step40.ckpt", step=40)
    assert _code_legs(code, None, fresh, {"global_step": 30, "normlab": {"code_legs": [a]}}) == [a, b(30)]
    assert _code_legs(code, None, fresh, {"global_step": 30}) == [unknown, b(30)]
    assert _code_legs(code, None, fresh, None) == [b(0)]
    assert _code_legs(code, None, own, None) == [unknown, b(40)]  # no such file: its legs unknown
    assert _code_legs(None, None, own, None) is None


def test_legs_of_the_folders_own_checkpoint_are_read_from_it(tmp_path):
    """A fit that fails before its own checkpoint loads still records the legs that checkpoint
    holds (read weights-only with mmap); an unreadable one leaves them unknown."""
    from types import SimpleNamespace

    from normlab.train import _code_legs

    code = {"commit": "b" * 40, "dirty": False}
    a = {"from_step": 0, "commit": "a" * 40, "dirty": False}
    ck = tmp_path / "full-step40.ckpt"
    torch.save({"global_step": 40, "state_dict": {"w": torch.ones(2)}, "normlab": {"code_legs": [a]}}, ck)
    own = SimpleNamespace(checkpoint=str(ck), step=40)
    assert _code_legs(code, None, own, None) == [a, {"from_step": 40, **code}]
    unknown = [{"from_step": 0, "commit": None, "dirty": None}, {"from_step": 40, **code}]
    for bad in (torch.ones(3), {"code_legs": torch.ones(3)}, {"code_legs": [{"commit": torch.ones(1)}]}):
        torch.save({"global_step": 40, "normlab": bad}, ck)  # not the callback's state: unknown
        assert _code_legs(code, None, own, None) == unknown
        assert _code_legs(code, None, SimpleNamespace(checkpoint=None, step=0),
                          {"global_step": 40, "normlab": bad}) == unknown  # resume= likewise
    ck.write_bytes(ck.read_bytes()[:50])  # truncated
    assert _code_legs(code, None, own, None) == [{"from_step": 0, "commit": None, "dirty": None},
                                                 {"from_step": 40, **code}]


def test_legs_of_a_fit_that_failed_before_its_checkpoint_loaded():
    """With the full-checkpoint callback, a fit that fails before Lightning loads the checkpoint
    (the callback then knows no earlier legs and no start step) must not record one leg of this
    commit from step 0: the folder's own checkpoint gives its step (and its legs, when it can be read:
    the test above; this one is missing, so they are unknown), resume= its checkpoint's legs. Once
    loaded, the callback's legs are the record."""
    from types import SimpleNamespace

    from normlab.callbacks.full_checkpoint import FullStateCheckpoint
    from normlab.train import _code_legs

    code = {"commit": "b" * 40, "dirty": False}
    a = {"from_step": 0, "commit": "a" * 40, "dirty": False}
    b = lambda step: {"from_step": step, "commit": "b" * 40, "dirty": False}  # noqa: E731
    unknown = {"from_step": 0, "commit": None, "dirty": None}
    fresh, own = SimpleNamespace(checkpoint=None, step=0), SimpleNamespace(checkpoint="full-step40.ckpt", step=40)
    full = FullStateCheckpoint(every_n_steps=5)
    full.code = code
    assert _code_legs(code, full, own, None) == [unknown, b(40)]
    assert _code_legs(code, full, fresh, {"global_step": 30, "normlab": {"code_legs": [a]}}) == [a, b(30)]
    assert _code_legs(code, full, fresh, None) == [b(0)]  # a new run
    trainer = SimpleNamespace(global_rank=0)
    saved = {"global_step": 40, "normlab": {"train_tokens": 1, "train_seconds": 1.0, "wall_s": 2.0, "rng": [{}],
                                            "code_legs": [a]}}

    def broken(*args):
        raise RuntimeError("the load failed")

    with pytest.raises(RuntimeError):  # a load that fails part-way: the callback still knows nothing
        full.on_load_checkpoint(trainer, SimpleNamespace(restore_throughput_counters=broken), saved)
    assert _code_legs(code, full, fresh, {"global_step": 40, "normlab": {"code_legs": [a]}}) == [a, b(40)]
    full.on_load_checkpoint(trainer, SimpleNamespace(restore_throughput_counters=lambda *a: None), saved)
    assert _code_legs(code, full, own, None) == [a, b(40)]  # the folder's own, loaded
    assert _code_legs(code, full, fresh, {"global_step": 40, "normlab": {"code_legs": [a]}}) == [a, b(40)]  # resume=

