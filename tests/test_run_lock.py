"""One process per run folder: a second copy of a running command stops with one line naming the
holder (it does not train into the same files); a killed holder's lock is taken over by the rerun,
which continues the run; the lock file is gone when a run ends."""
import json
import signal
import time

from test_runs_survive import overrides, train_subprocess


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
