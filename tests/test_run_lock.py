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
    record = {k: v for k, v in contents(run_dir).items() if k.startswith(".hydra/") or k.endswith(".log")}
    second = train_subprocess(args + ["trainer.enable_model_summary=false"])  # a setting the first never ran with
    assert second.returncode == 2, second.stderr[-2000:]
    err = second.stderr.strip().splitlines()
    assert err[-1].startswith(f"error: {run_dir}: in use by process {first.pid} on ") and "Traceback" not in second.stderr
    assert len([line for line in err if line.startswith("error:")]) == 1
    assert {k: v for k, v in contents(run_dir).items() if k in record} == record and len(record) >= 3
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
    holder = hold(run_dir)  # another process's run, training
    try:
        record_failure(cfg, ConfigError("trainer.accelerator", "'gpu': this machine has no CUDA GPU"))
        assert not (run_dir / "results.json").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    with locked(run_dir):  # this process's own run, failed: its record is written while it holds the folder
        record_failure(cfg, ConfigError("trainer.accelerator", "'gpu': this machine has no CUDA GPU"))
        assert json.loads((run_dir / "results.json").read_text())["status"] == "failed"
    (run_dir / "results.json").unlink()
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


# ---------------------------------------------------------------- a refused copy changes nothing (issue 37)

HOLDER = """import sys
from pathlib import Path
from normlab.run_folder import locked
with locked(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


def hold(run_dir):
    """Another process holding `run_dir` by run_folder.locked, until its stdin is closed."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def held_folder(run_dir) -> dict:
    """A run folder as a running run keeps it (its record, its log): {file: bytes}."""
    for name, text in ((".hydra/config.yaml", "seed: 1\n"), (".hydra/hydra.yaml", "hydra:\n  job:\n    name: train\n"),
                       (".hydra/overrides.yaml", "- seed=1\n"), ("train.log", "[step 6] the holder's line\n")):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    return contents(run_dir)


def contents(run_dir) -> dict:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.integration
def test_a_refused_copy_rewrites_nothing_in_the_held_folder(tmp_path, monkeypatch, capsys):
    """The second copy of a running command stops on the lock before anything is written into the
    folder: one `error:` line, exit 2, and the running run's .hydra/ and log byte for byte as they
    were (was: Hydra had rewritten .hydra/config.yaml, hydra.yaml and overrides.yaml with the second
    copy's settings before the job reached the lock)."""
    from normlab.commands.train import main as train_main

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    before = held_folder(run_dir)
    holder = hold(run_dir)
    try:
        assert train_main([f"hydra.run.dir={run_dir}", "logger=csv", "trainer.log_every_n_steps=3"]) == 2
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: {run_dir}: in use by process {holder.pid} on "), out.err
    assert "Traceback" not in out.err + out.out
    assert contents(run_dir) == before  # .lock: removed by the holder as it ended


@pytest.mark.integration
def test_a_refused_multirun_job_is_reported_and_the_sweep_goes_on_and_exits_2(tmp_path, monkeypatch, capsys):
    """A multirun beside another process that holds one of its job folders: that job prints its
    one line and writes nothing there (not .hydra/, not a line of the launcher's into the holder's
    log), the next job runs, and the multirun exits 2 (was: nothing printed, exit 0)."""
    from normlab.commands.train import main as train_main

    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    before = held_folder(sweep / "0")
    holder = hold(sweep / "0")
    try:  # job 1 fails on its own bad value: recorded, as any failed job of a sweep (failure.py)
        code = train_main(["-m", "norm.type=layernorm,groupnorm", "logger=csv", f"hydra.sweep.dir={sweep}",
                           "hydra.sweep.subdir=${hydra.job.num}"])
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 2, out.err
    assert errors[0].startswith(f"error: {sweep / '0'}: in use by process {holder.pid} on ")
    assert errors[1] == (f"error: {sweep}: 1 job(s) of this multirun did not run: their run folders are in use by "
                         "another process (above); rerun the same command once it ends")  # where: the sweep folder
    assert contents(sweep / "0") == before
    assert json.loads((sweep / "1" / "results.json").read_text())["status"] == "failed"  # it ran
    assert "norm.type=groupnorm" in (sweep / "1" / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.integration
def test_the_record_a_job_saves_is_the_one_hydra_saves(tmp_path, monkeypatch):
    """.hydra/ is written by the job once it holds the folder (hydra.output_subdir is null): its three
    files are byte for byte what Hydra writes when its own saving is on (here into .hydra_by_hydra),
    so everything that reads a run's record (report, evaluate, prune) reads the same files."""
    from normlab.commands.train import main as train_main

    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    assert train_main(["-m", "norm.type=groupnorm", "seed=3", "logger=csv", f"hydra.sweep.dir={sweep}",
                       "hydra.sweep.subdir=${hydra.job.num}", "hydra.output_subdir=.hydra_by_hydra"]) == 0
    ours, hydras = sweep / "0" / ".hydra", sweep / "0" / ".hydra_by_hydra"
    names = ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in hydras.iterdir()) == names
    for name in names:
        assert (ours / name).read_bytes() == (hydras / name).read_bytes(), name
    assert "seed=3" in (ours / "overrides.yaml").read_text()


SECOND_COPY = """import sys
from pathlib import Path
from normlab.run_folder import RunFolderInUse, locked
try:
    with locked(Path(sys.argv[1])):
        print("taken")
except RunFolderInUse:
    print("refused")
"""


def second_copy(run_dir) -> str:
    """What a second copy of the command, starting now in another process, finds: `taken` or `refused`."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", SECOND_COPY, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip()


@pytest.mark.integration
def test_a_failed_job_keeps_its_folder_until_its_failure_is_recorded(tmp_path, monkeypatch):
    """A job that fails is recorded (results.json `failed`) while it still holds its folder: a copy
    started between the failure and its record is refused, and the record is written by the job
    that failed (was: the lock was let go first, so a second copy could take the folder and the
    failed run's record then went into, or was kept out of, a folder the other copy was training in)."""
    import normlab.failure as failure
    from normlab.commands.train import main as train_main

    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    found = []
    real = failure.record_failure

    def record_failure(cfg, err, runtime=None):
        found.append(second_copy(sweep / "0"))
        return real(cfg, err, runtime)

    monkeypatch.setattr(failure, "record_failure", record_failure)
    assert train_main(["-m", "norm.type=groupnorm", "logger=csv", f"hydra.sweep.dir={sweep}",
                       "hydra.sweep.subdir=${hydra.job.num}"]) == 0  # a failed job of a sweep: recorded, exit 0
    assert found == ["refused"]
    results = json.loads((sweep / "0" / "results.json").read_text())
    assert results["status"] == "failed" and "groupnorm" in results["error"]
    assert not (sweep / "0" / ".lock").exists() and second_copy(sweep / "0") == "taken"


@pytest.mark.integration
def test_a_refused_job_under_submitit_local_makes_the_multirun_exit_2(tmp_path, monkeypatch, capsys):
    """hydra/launcher=submitit_local runs each job in a worker process of its own: a refused job there
    fails its job, so the multirun, once every job has run, prints the refusal in its one line and
    exits 2, as under the basic launcher (was: exit 0, the refusal only in the worker's log)."""
    from normlab.commands.train import main as train_main

    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    before = held_folder(sweep / "0")
    holder = hold(sweep / "0")
    try:  # job 1 fails on its own bad value: recorded, and not a reason to exit 2
        code = train_main(["-m", "norm.type=layernorm,groupnorm", "logger=csv", f"hydra.sweep.dir={sweep}",
                           "hydra.sweep.subdir=${hydra.job.num}", "hydra/launcher=submitit_local",
                           "hydra.launcher.timeout_min=10"])
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, out.err
    assert errors[0].startswith(f"error: {sweep / '0'}: in use by process {holder.pid} on "), out.err
    assert "Traceback" not in out.err + out.out
    assert contents(sweep / "0") == before
    assert json.loads((sweep / "1" / "results.json").read_text())["status"] == "failed"  # it ran
    assert list(sweep.glob(".submitit/*/*_log.out"))  # in submitit's workers
