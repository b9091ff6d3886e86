"""A screen continues from its committed rung records (study/screen_run.py): each setting's run at its
rung is recorded in <out>/screen/<arm>/<setting>/ (results.json, metrics.csv), so on a fresh clone (the
run folders gone) the settings dropped at a rung train nothing, the kept ones train again from step 0,
the choice is the one an uninterrupted screen makes, and --status shows where each is. A record of
another identity is not read. The runs are a fake trainer (no model): what the screen reads of a run
folder, written as train.py writes it."""
import json
import shutil
import sys

import pytest

from normlab.study.screen_run import RungSweep, run_screens, screen_jobs
from normlab.study.screen_status import screened_status_lines, setting_state

from test_study_screen_status import H2, H4, W2, W4, flat, tiny  # noqa: F401 (tiny: the fixture)

# train.py as the screen sees it: continues its run folder to the pause (stop_at_step), logging a
# validation every 3 steps whose loss falls faster with a higher lr and a shorter warmup; its CPU time
# (10 s a step) and code legs over all its legs, as full_checkpoint.py counts them
TRAIN = r'''
import json, os, sys
from pathlib import Path
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
run, stop = Path(args["hydra.run.dir"]), int(args["callbacks.preemption.stop_at_step"])
lr, warmup = float(args["optim.lr"]), int(args["optim.warmup"])
res = json.loads((run / "results.json").read_text()) if (run / "results.json").is_file() else {}
start = int(res.get("steps") or 0)
with open(os.environ["FAKE_TRAIN_LOG"], "a") as log:
    log.write(f"{run.name} {start} {stop}\n")
(run / "csv").mkdir(parents=True, exist_ok=True)
(run / "checkpoints").mkdir(exist_ok=True)
csv = run / "csv" / "metrics.csv"
rows = "" if csv.is_file() else "epoch,step,train/loss,valid/loss\n"
rows += "".join(f"0,{s - 1},,{round(8.0 - s * lr * 1000 / warmup, 6)}\n" for s in range(start + 1, stop + 1) if s % 3 == 0)
with open(csv, "a") as f:
    f.write(rows)
(run / "checkpoints" / f"full-step{stop}.ckpt").write_bytes(b"weights")
legs = res.get("code_legs", []) + [{"from_step": start, "commit": "c1", "dirty": False}]  # provenance.code_legs
(run / "results.json").write_text(json.dumps({"status": "stopped", "steps": stop, "cpu_s": 10.0 * stop,
                                              "wall_s": 5.0 * stop, "identity_hash": args["hash"],
                                              "code_legs": legs}))
'''


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    """The fake trainer in place of train.py; returns a reader of what it trained: [(run, from, to)]."""
    script, log = tmp_path / "fake_train.py", tmp_path / "trained.txt"
    script.write_text(TRAIN)
    log.write_text("")
    monkeypatch.setenv("FAKE_TRAIN_LOG", str(log))
    real = RungSweep._train_command
    monkeypatch.setattr(RungSweep, "_train_command", lambda self, job: [
        sys.executable, str(script), *real(self, job)[3:], f"hash={job.identity_hash}"])

    def trained():
        runs = [line.split() for line in log.read_text().splitlines()]
        log.write_text("")
        return [(name, int(a), int(b)) for name, a, b in runs]
    return trained


def first_rung(study, runs, out):
    """The screen's first rung, run as run_screens runs it: every setting to step 3."""
    jobs = screen_jobs(study, study.arms["a"], runs, out, [W2, W4, H2, H4], 3)
    sweep = RungSweep(study, list(jobs.values()), runs)
    assert sweep.run() == 0 and not sweep.failed
    sweep.log_file.close()
    return jobs


def test_a_setting_at_its_rung_is_recorded_in_the_study_folder(tiny, trainer):
    study, runs, out, _ = tiny
    jobs = first_rung(study, runs, out)
    assert len(trainer()) == 4
    for name, job in jobs.items():
        assert job.record == out / "screen" / "a" / name
        assert sorted(p.name for p in job.record.iterdir()) == ["metrics.csv", "results.json"]  # no checkpoint
        res = json.loads((job.record / "results.json").read_text())
        assert (res["identity_hash"], res["rung"], res["status"], res["steps"]) == (job.identity_hash, 3, "stopped", 3)
        assert res["cpu_s"] == 30.0 and res["wall_s"] == 15.0 and res["study"]["seed"] == 1
        assert (job.record / "metrics.csv").read_text() == (job.run_dir / "csv" / "metrics.csv").read_text()
    assert not list((out / "screen" / "a").glob(".*"))  # no temp folder left
    # the next rung replaces the kept settings' records (H2 and H4: the higher lr goes on)
    assert run_screens(study, runs, out) == 0
    assert trainer() == [(jobs[H2].run_dir.name, 3, 6), (jobs[H4].run_dir.name, 3, 6)]
    res = json.loads((jobs[H2].record / "results.json").read_text())
    assert (res["rung"], res["steps"]) == (6, 6) and "0,5,," in (jobs[H2].record / "metrics.csv").read_text()
    assert json.loads((jobs[W2].record / "results.json").read_text())["rung"] == 3


def test_a_screen_continues_from_its_rung_records_on_a_fresh_clone(tiny, trainer, tmp_path):
    study, runs, out, _ = tiny
    straight = tmp_path / "straight"  # the same screen, never interrupted
    assert run_screens(study, straight / "runs", straight / "out") == 0
    trainer()
    jobs = first_rung(study, runs, out)
    assert len(trainer()) == 4
    shutil.rmtree(runs)  # a fresh clone: the committed <out> only
    lines = screened_status_lines(study, runs, out, None)
    assert lines[1] == "screen a, at rung 6: 2 left, 2 kept"
    assert flat(lines[2]) == f"{W2} left at rung 3: valid_loss 6.500"
    assert flat(lines[4]) == (f"{H2} kept at rung 3 (valid_loss 3.500): its run folder is gone, trains again from "
                              "step 0 to rung 6")
    assert [setting_state(jobs[n], 3, "valid_loss").state for n in jobs] == ["at rung"] * 4
    assert run_screens(study, runs, out) == 0
    # the dropped settings train nothing; the kept ones train again from step 0 to the next rung
    assert trainer() == [(jobs[H2].run_dir.name, 0, 6), (jobs[H4].run_dir.name, 0, 6)]
    mine, theirs = (json.loads((o / "screen" / "a.json").read_text()) for o in (out, straight / "out"))
    assert mine == theirs and mine["chosen"] == H2
    assert [r["values"]["3"] for r in mine["settings"]] == [6.5, 7.25, 3.5, 5.75]


def test_a_rung_record_of_another_identity_is_not_read(tiny, trainer):
    study, runs, out, _ = tiny
    jobs = first_rung(study, runs, out)
    trainer()
    shutil.rmtree(runs)
    for job in jobs.values():  # a record of the grid or arm as it was (another identity hash)
        res = json.loads((job.record / "results.json").read_text())
        (job.record / "results.json").write_text(json.dumps({**res, "identity_hash": "0" * 16}))
    assert [setting_state(jobs[n], 3, "valid_loss").state for n in jobs] == ["not started"] * 4
    assert screened_status_lines(study, runs, out, None)[1] == "screen a, at rung 3: 4 not started"
    first_rung(study, runs, out)
    assert sorted(trainer()) == sorted((job.run_dir.name, 0, 3) for job in jobs.values())  # all four again
    assert all(json.loads((j.record / "results.json").read_text())["identity_hash"] == j.identity_hash
               for j in jobs.values())  # and recorded anew


def test_a_rung_record_without_its_metrics_is_no_record(tiny, trainer):
    """Only results.json committed: the setting trains again rather than be ranked without a value
    (as a diverged one) and dropped."""
    study, runs, out, _ = tiny
    jobs = first_rung(study, runs, out)
    trainer()
    shutil.rmtree(runs)
    (jobs[H2].record / "metrics.csv").unlink()
    assert [setting_state(jobs[n], 3, "valid_loss").state for n in jobs] == ["at rung", "at rung", "not started",
                                                                            "at rung"]
    first_rung(study, runs, out)
    assert trainer() == [(jobs[H2].run_dir.name, 0, 3)]
    assert (jobs[H2].record / "metrics.csv").is_file()  # recorded anew, whole


def test_a_damaged_rung_record_is_shown_damaged_as_the_study_refuses_it(tiny, trainer):
    study, runs, out, _ = tiny
    jobs = first_rung(study, runs, out)
    trainer()
    shutil.rmtree(runs)
    (jobs[W4].record / "results.json").write_text('{"status": "stopp')  # cut off
    state = setting_state(jobs[W4], 3, "valid_loss")
    assert state.state == "damaged" and "rung record" in state.text
    sweep = RungSweep(study, list(jobs.values()), runs)
    assert sweep.run() == 0 and len(sweep.refused) == 1  # the study leaves it out too, and trains nothing
    sweep.log_file.close()
    assert trainer() == []


def test_a_stale_run_folder_does_not_replace_a_record_that_went_further(tiny, trainer, tmp_path):
    """Machine A's run folders at rung 3; machine B took the screen on to rung 6 and committed its
    records; A runs the screen again: its folders neither replace B's records nor train again."""
    study, runs, out, _ = tiny
    first_rung(study, runs, out)
    trainer()
    stale = tmp_path / "stale"
    shutil.copytree(runs, stale)  # A's run folders, at rung 3
    assert run_screens(study, runs, out) == 0 and len(trainer()) == 2  # B: H2 and H4 on to rung 6
    jobs = screen_jobs(study, study.arms["a"], stale, out, [W2, W4, H2, H4], 3)
    records = {n: (j.record / "results.json").read_text() for n, j in jobs.items()}
    choice = json.loads((out / "screen" / "a.json").read_text())
    (out / "screen" / "a.json").unlink()  # so that A's screen ranks every rung again
    assert run_screens(study, stale, out) == 0
    assert trainer() == []
    assert {n: (j.record / "results.json").read_text() for n, j in jobs.items()} == records
    assert json.loads((out / "screen" / "a.json").read_text()) == choice
