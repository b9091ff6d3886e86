"""normlab's own writes give new files the mode open() gives them under the umask (0o666 & ~umask)
and new folders mkdir's (0o777 & ~umask): mkstemp (every atomic write: results.json, run.json,
test.hyp, checkpoints) makes 0600 whatever the umask, which kept a shared run folder's results from
the colleagues it was shared with (issue 37). The umask is read without being changed."""
import os

import pytest

from normlab.checkpoint import atomic_write_bytes, write_json
from normlab.file_mode import creation_mode, umask
from normlab.run_folder import locked
from normlab.train import run

from conftest import compose_cfg, tiny_overrides


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077, 0o027], ids=oct)
def test_atomic_writes_and_the_lock_file_follow_the_umask(mask, tmp_path):
    old = os.umask(mask)
    try:
        assert umask() == mask and os.umask(mask) == mask  # read, not changed
        mode = creation_mode()
        write_json(tmp_path / "results.json", {"status": "completed"})
        atomic_write_bytes(tmp_path / "sub" / "test.hyp", lambda f: f.write(b"a hypothesis\n"))
        (tmp_path / "old.json").write_text("{}")
        os.chmod(tmp_path / "old.json", 0o600)
        write_json(tmp_path / "old.json", {})  # a replaced file takes the new file's mode, as open(..., "w") + rename
        with locked(tmp_path / "run"):
            lock_mode = (tmp_path / "run" / ".lock").stat().st_mode & 0o777
        plain = tmp_path / "plain"
        plain.write_text("")
    finally:
        os.umask(old)
    want = plain.stat().st_mode & 0o777
    assert want == 0o666 & ~mask == mode
    for name in ("results.json", "sub/test.hyp", "old.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == want, name
    assert (tmp_path / "sub").stat().st_mode & 0o777 == 0o777 & ~mask
    assert lock_mode == want  # a colleague's rerun opens a lock file a killed holder left
    assert not list(tmp_path.rglob(".*.tmp"))


def test_creation_mode_is_the_mode_open_and_mkdir_give(tmp_path):
    (tmp_path / "f").write_text("")
    (tmp_path / "d").mkdir()
    assert creation_mode() == (tmp_path / "f").stat().st_mode & 0o777
    assert creation_mode(folder=True) == (tmp_path / "d").stat().st_mode & 0o777


@pytest.mark.integration
def test_files_a_run_writes_follow_the_umask(small_corpus, tmp_path):
    """results.json, run.json, test.hyp and the checkpoints (atomic writes through mkstemp, which
    makes 0600) get what open() gives under the umask: 0644 under 022 (was: 0600, unreadable to
    the colleagues sharing a run folder)."""
    run_dir = tmp_path / "run"
    old = os.umask(0o022)
    try:
        run(compose_cfg(tiny_overrides(small_corpus, run_dir, tmp_path / "cache") + [
            "eval.test_greedy=false", "callbacks.step_checkpoints.every_n_steps=2"]))  # and an averaged checkpoint
    finally:
        os.umask(old)
    written = [run_dir / "results.json", run_dir / "run.json", run_dir / "test.hyp",
               *sorted((run_dir / "checkpoints").glob("*.ckpt"))]
    assert len(written) >= 6  # best, last, full, step and averaged checkpoints among them
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {p.name: oct(0o644) for p in written}
