"""One process per run folder: a second copy of a running command stops with one line naming the
holder (it does not train into the same files); a killed holder's lock is taken over by the rerun,
which continues the run; the lock file is gone when a run ends."""
import json
import signal
import time

import pytest

from test_runs_survive import overrides, train_subprocess


@pytest.mark.integration
def test_a_second_copy_is_refused_and_a_dead_holders_lock_is_taken_over(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = overrides(small_corpus, run_dir, tmp_path / "cache")
    first = train_subprocess(args, at_step=6, sig=signal.SIGSTOP, wait=False)  # holds the folder, suspended
    deadline = time.time() + 120
    while time.time() < deadline and not (run_dir / "checkpoints" / "full-step5.ckpt").is_file():
        time.sleep(0.2)
    time.sleep(1.0)  # at its step-6 SIGSTOP by now
    second = train_subprocess(args)
    assert second.returncode == 2, second.stderr[-2000:]
    err = second.stderr.strip().splitlines()
    assert err[-1].startswith(f"error: {run_dir}: in use by process {first.pid} on ") and "Traceback" not in second.stderr
    assert (run_dir / ".lock").is_file() and not (run_dir / "results.json").exists()
    first.send_signal(signal.SIGKILL)  # the holder dies: its flock goes with it, the file stays
    first.wait(timeout=60)
    assert (run_dir / ".lock").is_file()
    third = train_subprocess(args)
    assert third.returncode == 0, third.stderr[-2000:]
    res = json.loads((run_dir / "results.json").read_text())
    assert res["status"] == "completed" and res["steps"] == 24
    assert "continuing from" in third.stderr + third.stdout  # from the killed run's checkpoint
    assert not (run_dir / ".lock").exists()


def test_a_failing_rerun_writes_nothing_into_a_held_or_finished_folder(tmp_path):
    """A second copy that fails before it reaches the lock (a bad value on the command line) records
    nothing in the folder another process is training in, and a typo in the rerun of a finished run
    leaves that run finished (its next correct rerun still skips it)."""
    import json

    from normlab.config import ConfigError
    from normlab.failure import record_failure
    from normlab.run_folder import locked

    from conftest import compose_cfg

    run_dir = tmp_path / "run"
    cfg = compose_cfg([f"run_dir={run_dir}"])
    with locked(run_dir):  # another process's run, training
        record_failure(cfg, ConfigError("trainer.accelerator", "'gpu': this machine has no CUDA GPU"))
        assert not (run_dir / "results.json").exists()
    finished = {"status": "completed", "test_bleu": 12.3}
    (run_dir / "results.json").write_text(json.dumps(finished))
    record_failure(cfg, ConfigError("trainer.max_time", "'abc' is not valid"))
    assert json.loads((run_dir / "results.json").read_text()) == finished
    (run_dir / "results.json").write_text(json.dumps({"status": "preempted", "steps": 4}))
    record_failure(cfg, ConfigError("trainer.max_time", "'abc' is not valid"))  # unfinished: recorded
    assert json.loads((run_dir / "results.json").read_text())["status"] == "failed"


def test_a_status_probe_is_not_a_holder(tmp_path):
    """`normlab-study --status` probes a folder's lock with a brief shared flock (held_elsewhere): a
    run that starts during the probe waits it out instead of stopping as if the run were held; a
    folder held for longer still refuses."""
    import fcntl
    import os
    import threading

    from normlab.run_folder import RunFolderInUse, held_elsewhere, locked

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a probe, caught mid-probe
    threading.Timer(0.05, fcntl.flock, (fd, fcntl.LOCK_UN)).start()
    with locked(run_dir):
        assert held_elsewhere(run_dir)
    assert not held_elsewhere(run_dir) and not (run_dir / ".lock").exists()
    (run_dir / ".lock").write_text("process 1 on elsewhere since then")
    fd2 = os.open(run_dir / ".lock", os.O_RDWR)
    fcntl.flock(fd2, fcntl.LOCK_EX)  # a real holder
    t0 = time.time()
    with pytest.raises(RunFolderInUse, match="in use by process 1 on elsewhere"):
        with locked(run_dir):
            pass
    assert time.time() - t0 < 2.0
    os.close(fd2)
    os.close(fd)


def test_a_holder_that_ends_during_the_wait_leaves_one_holder(tmp_path):
    """A holder removes its lock file when it ends: a run that was waiting on that file must lock
    the folder's lock file anew, or it would hold a file no other process can see, and a third copy
    would train beside it."""
    import fcntl
    import os
    import threading

    from normlab.run_folder import held_elsewhere, locked

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the holder

    def holder_ends():
        os.unlink(path)  # as locked() ends: unlink while held, then release
        os.close(fd)

    threading.Timer(0.05, holder_ends).start()
    with locked(run_dir):
        assert path.is_file() and held_elsewhere(run_dir)  # the folder's own lock file, held
    assert not path.exists()
