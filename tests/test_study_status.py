"""normlab-study NAME --status: each planned run's state, read from the records and run folders, and
the machine-hours left, with nothing run, copied or written."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from normlab.run_folder import locked
from normlab.study.plan import plan
from normlab.study.runner import Sweep
from normlab.study.spec import load_study
from normlab.study.status import job_state, status_lines

ROOT = Path(__file__).resolve().parents[1]
STUDY = """title: t
paper: p
question: q
seeds: [1, 2]
arms:
  a: {overrides: [norm=prenorm]}
  b: {overrides: [norm=postnorm]}
claims:
  - {id: c, claim: a beats b, source: s, paper: '+1', better: a, than: b}
"""


def _setup(tmp_path):
    path = tmp_path / "st.yaml"
    path.write_text(STUDY)
    study = load_study(str(path), "smoke")
    runs, out = tmp_path / "runs", tmp_path / "out"
    jobs = plan(study, runs, out)  # seed-major: a s1, b s1, a s2, b s2
    rec = jobs[0].record
    rec.mkdir(parents=True)  # a s1: recorded, an hour of the whole machine
    (rec / "results.json").write_text(json.dumps({
        "status": "completed", "identity_hash": jobs[0].identity_hash, "test_bleu": 12.5, "steps": 400,
        "wall_s": 3600.0, "study": {"arm": "a", "seed": 1, "jobs": 1}}))
    stopped = jobs[1].run_dir  # b s1: stopped at its step-200 checkpoint, half of its 400 steps
    (stopped / "checkpoints").mkdir(parents=True)
    (stopped / "checkpoints" / "full-step200.ckpt").write_bytes(b"")
    (stopped / "checkpoints" / "full-step100.ckpt").write_bytes(b"")
    (stopped / "train.log").write_text("[x] step 225/400 | loss 5.1\n[x] step 250/400 | loss 5.0\n")
    running = jobs[2].run_dir  # a s2: training now (its folder held), no checkpoint yet
    running.mkdir(parents=True)
    (running / "train.log").write_text("[x] step 25/400 | loss 7.1 | elapsed 0:00:20 | eta 0:05:00\n"
                                       "[x] step 30/400 | loss 7.0 | tgt tok/s 4,161 | elapsed 0:00:24 | eta 0:04:56\n")
    return study, jobs, path, runs, out


def test_each_run_has_its_state_and_the_time_left_is_estimated(tmp_path):
    study, jobs, path, runs, out = _setup(tmp_path)
    with locked(jobs[2].run_dir):
        lines = status_lines(study, jobs, None)
    assert lines[0] == "st (smoke): 4 runs planned: 1 recorded, 1 training now, 1 stopped part-way, 1 not started"
    assert "a seed 1  recorded: status completed, test BLEU 12.5, steps 400, wall s 3600.0" in lines[1]
    assert lines[2].endswith("b seed 1  stopped part-way: its step-200 checkpoint of 400; the study continues it")
    assert lines[3].endswith("a seed 2  training now: step 30 of 400, training ends in about 0:04:56")
    assert lines[4].endswith("b seed 2  not started")
    # left: half of b s1, all of a s2 and b s2, at the recorded run's 1.00 machine-hour each
    assert lines[5].startswith("left: about 2.50 machine-hours (the mean of its 1 completed runs, 1.00 h a run")
    # not held: the same folder is a run that started and left no checkpoint (it starts over)
    assert status_lines(study, jobs, None)[3].endswith("a seed 2  started, no checkpoint yet: starts over")


def test_a_run_another_study_recorded_counts_as_recorded(tmp_path):
    study, jobs, path, runs, out = _setup(tmp_path)
    other = tmp_path / "experiments" / "other" / "runs" / "b-s2"
    other.mkdir(parents=True)
    (other / "results.json").write_text(json.dumps({"status": "completed", "identity_hash": jobs[3].identity_hash,
                                                    "group": "study-other"}))
    lines = status_lines(study, jobs, tmp_path / "experiments")
    assert lines[4].endswith("b seed 2  recorded by other (the same run): copied in when the study runs")
    assert "2 recorded" in lines[0] and not jobs[3].record.exists()  # nothing copied


@pytest.mark.integration
def test_the_command_prints_the_status_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from normlab.commands.study import main

    study, jobs, path, runs, out = _setup(tmp_path)
    files = lambda: sorted((p, p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))  # noqa: E731
    before = files()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    # the command's main in this process (its console script is tested in test_study.py): no imports to wait for
    assert main([str(path), "study.budget=smoke", "--status", "--out", str(out), "--runs", str(runs)]) == 0
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0].startswith("st (smoke): 4 runs planned: 1 recorded, 1 stopped part-way")
    assert "left: about 2.50 machine-hours" in stdout  # a s2's folder not held: not started, as b s2
    assert files() == before  # no README, no study.log, no record, nothing rewritten


@pytest.mark.parametrize("results, ckpt, log, held, state, text, done", [
    ({"status": "preempted", "steps": 200}, 200, "step 200/400", False, "stopped part-way",
     "stopped part-way: its step-200 checkpoint of 400; the study continues it", 0.5),
    ({"status": "stalled", "steps": 300, "test_bleu": 0.0}, 0, "", False, "finished",
     "finished (status stalled, test BLEU 0.0, steps 300); recorded when the study next runs", 1.0),
    ({"status": "failed", "error": "Traceback ...\nRuntimeError: out of memory"}, 100, "step 120/400", False, "failed",
     "failed (RuntimeError: out of memory); the study runs it again", 0.25),
    (None, 0, "", True, "training now", "training now: starting", 0.0),
    # stopped in its final scoring: trained to the end, its scoring still to do
    ({"status": "interrupted"}, 400, "step 400/400", False, "stopped part-way",
     "stopped part-way: its step-400 checkpoint of 400; the study continues it", 0.9),
])
def test_the_state_of_a_run_folder(tmp_path, results, ckpt, log, held, state, text, done):
    study, jobs, path, runs, out = _setup(tmp_path)
    job = jobs[3]  # b s2: no folder yet
    job.run_dir.mkdir(parents=True)
    if results is not None:
        (job.run_dir / "results.json").write_text(json.dumps(results))
    if ckpt:
        (job.run_dir / "checkpoints").mkdir()
        (job.run_dir / "checkpoints" / f"full-step{ckpt}.ckpt").write_bytes(b"")
    if log:
        (job.run_dir / "train.log").write_text(f"[x] {log} | loss 5.0\n")
    if held:
        with locked(job.run_dir):
            got = job_state(job, {})
    else:
        got = job_state(job, {})
    assert got == (state, text, done)


def test_a_completed_run_of_a_pruned_arm_waits_for_its_prune(tmp_path):
    study, jobs, path, runs, out = _setup(tmp_path)
    job = replace(jobs[3], arm=replace(jobs[3].arm, prune={"depths": [1], "strategies": ["every_other"]}))
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "results.json").write_text(json.dumps({"status": "completed", "test_bleu": 3.0}))
    assert job_state(job, {})[1] == "finished (status completed, test BLEU 3.0); pruned and recorded when the study next runs"


def test_the_estimate_is_the_mean_of_completed_runs(tmp_path):
    # a stalled run stops early: its hour would make the estimate short
    study, jobs, path, runs, out = _setup(tmp_path)
    rec = jobs[3].record
    rec.mkdir(parents=True)
    (rec / "results.json").write_text(json.dumps({
        "status": "stalled", "identity_hash": jobs[3].identity_hash, "steps": 100, "wall_s": 360.0,
        "study": {"arm": "b", "seed": 2, "jobs": 1}}))
    last = status_lines(study, jobs, None)[-1]
    assert last.startswith("left: about 1.50 machine-hours (the mean of its 1 completed runs, 1.00 h a run"), last


def test_the_sweep_estimates_from_the_runs_it_trained(tmp_path):
    study, jobs, path, runs, out = _setup(tmp_path)
    sweep = Sweep(study, jobs, runs, parallel=2)
    sweep.total, sweep.recorded = 10, 1  # one found finished: recorded at once, no pace yet
    assert sweep._progress() == "1 of 10 recorded"
    # two completed here, 25 minutes each on average; a stall that stopped early is no pace beside them
    sweep.recorded, sweep.trained = 3, [(1200.0, True), (1800.0, True), (250.0, False)]
    # 7 runs left, 2 at a time: 7 x 1500 s / 2 = 5250 s
    assert sweep._progress() == "3 of 10 recorded; about 1:27 left at this sweep's pace"
    sweep.recorded = 9  # the last run alone: 1500 s
    assert sweep._progress() == "9 of 10 recorded; about 0:25 left at this sweep's pace"
    sweep.failed = ["b seed 2"]  # not retried in this sweep: nothing left
    assert sweep._progress() == "9 of 10 recorded"
    sweep.log_file.close()


def test_a_run_the_sweep_continued_counts_whole_in_its_pace(tmp_path, capsys):
    # its training here took seconds (the rest was an earlier leg): the pace is its whole wall time
    import time

    study, jobs, path, runs, out = _setup(tmp_path)
    job = jobs[3]
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "results.json").write_text(json.dumps({"status": "completed", "wall_s": 1000.0, "steps": 400,
                                                          "identity_hash": job.identity_hash}))

    class Done:  # a train process that has just exited
        returncode = 0

        def poll(self):
            return 0

    sweep = Sweep(study, jobs, runs, parallel=2)
    sweep.total, sweep.recorded = 4, 0
    sweep.running[Done()] = (job, "train", time.time() - 5.0)
    sweep._reap()
    sweep.log_file.close()
    assert sweep.trained == [(1000.0, True)]
    # 3 runs left, 2 at a time, 1000 s a run: 1500 s
    assert capsys.readouterr().out.rstrip().endswith("(1 of 4 recorded; about 0:25 left at this sweep's pace)")
    assert (job.record / "results.json").is_file()
