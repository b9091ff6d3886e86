"""What a screen cost counts what the machines spent (study/cpu_ledger.py, screen_report.screen_cpu):
a rung record of another identity is not counted; a setting trained again from step 0 on a fresh
clone keeps the first machine's CPU time to the rung (work redone, spent all the same); a run another
study recorded at a rung and this study continued counts here only beyond that rung (the steps before
are the other study's); and the index's total adds each study's screens, a shared run's CPU time once.
Fake records and test_study_screen_records' fake trainer (no model)."""
import json
import shutil

from normlab.study.index import cost_table
from normlab.study.readme import _write_claims, cost
from normlab.study.runner import write_record
from normlab.study.screen import setting_name, setting_overrides, write_choice
from normlab.study.screen_report import screen_cpu, screen_lines, screens_cost
from normlab.study.screen_run import run_screens, screen_jobs

from test_study_screen_records import first_rung, trainer  # noqa: F401 (the fixture)
from test_study_screen_shared import second
from test_study_screen_status import H2, H4, W2, W4, tiny  # noqa: F401 (tiny: the fixture)

LEG0, LEG3 = {"from_step": 0, "commit": "c1", "dirty": False}, {"from_step": 3, "commit": "c1", "dirty": False}


def rung_record(job, cpu_s, steps=3, identity=None, legs=(LEG0,)):
    """A rung record as write_record leaves it from a run folder (before `cpu_spent`: its cpu_s alone)."""
    job.record.mkdir(parents=True, exist_ok=True)
    res = {"status": "stopped", "steps": steps, "rung": steps, "cpu_s": cpu_s, "code_legs": list(legs),
           "identity_hash": identity or job.identity_hash, "study": {"name": "st", "arm": "a", "seed": 1}}
    (job.record / "results.json").write_text(json.dumps(res))
    (job.record / "metrics.csv").write_text("epoch,step,train/loss,valid/loss\n0,2,,5.0\n")


def run_folder(job, cpu_s, steps, legs):
    """The setting's run folder paused at `steps` (what write_record copies)."""
    (job.run_dir / "csv").mkdir(parents=True, exist_ok=True)
    (job.run_dir / "csv" / "metrics.csv").write_text("epoch,step,train/loss,valid/loss\n0,5,,4.0\n")
    res = {"status": "stopped", "steps": steps, "cpu_s": cpu_s, "code_legs": legs, "identity_hash": job.identity_hash}
    (job.run_dir / "results.json").write_text(json.dumps(res))
    return res


def test_a_rung_record_of_another_identity_is_not_counted_and_the_readme_says_so(tiny):
    # before: its 3600 CPU s were summed into the screen's as if they were today's run's
    study, runs, out, _ = tiny
    jobs = screen_jobs(study, study.arms["a"], runs, out, [W2, W4, H2, H4], 3)
    for name in (W2, W4, H2):
        rung_record(jobs[name], 1800.0)
    rung_record(jobs[H4], 3600.0, identity="0" * 16)  # the grid or arm as it was: another run
    c = screen_cpu(study, out, "a")
    assert c["hours"] == {W2: 0.5, W4: 0.5, H2: 0.5} and c["other"] == [H4] and c["missing"] == []
    assert screens_cost(study, out) == ("; the screens: 1.50 CPU-hours more (the settings' runs to where each left, "
                                        "from their rung records; a chosen run continued as a seed counted once, in "
                                        "its seed's record; 1 rung record of another identity (a changed grid or arm) "
                                        "not counted)")
    rows = [{"name": setting_name(x), "overrides": setting_overrides(x), "values": {"3": 5.0}, "status": "stopped",
             "dropped_at": 3} for x in study.screen.settings()]
    write_choice(out / "screen" / "a.json", "a", study.screen, rows, W2)
    assert (f"; the rung records of {H4} hold another identity's run (a changed grid or arm): not this screen's, "
            "their CPU time not counted." in "\n".join(screen_lines(study, out, 12)))


def test_a_setting_trained_again_from_step_0_keeps_the_first_machines_cpu_time(tiny):
    # before: the new record's cpu_s (600) replaced the first machine's 300 s to the rung, counted nowhere
    study, runs, out, _ = tiny
    jobs = screen_jobs(study, study.arms["a"], runs, out, [W2, H2], 6)
    rung_record(jobs[H2], 300.0)
    res = run_folder(jobs[H2], 600.0, 6, [LEG0])  # a fresh clone: one leg from step 0 to the next rung
    write_record(study, jobs[H2], res, rung=6)
    c = screen_cpu(study, out, "a")
    assert c["hours"][H2] * 3600 == 900.0 and c["redone"][H2] * 3600 == 300.0
    spent = json.loads((jobs[H2].record / "results.json").read_text())["cpu_spent"]
    assert spent == [{"study": "st", "cpu_s": 300.0, "redone": True}, {"study": "st", "cpu_s": 600.0, "redone": False}]
    assert "; 0.08 of them on runs trained again from step 0 (work redone)" in screens_cost(study, out)
    # continued from its checkpoint instead (a second leg from step 3): its cpu_s holds the first 300 s, once
    rung_record(jobs[W2], 300.0)
    write_record(study, jobs[W2], run_folder(jobs[W2], 600.0, 6, [LEG0, LEG3]), rung=6)
    assert screen_cpu(study, out, "a")["hours"][W2] * 3600 == 600.0


def test_a_fresh_clones_screen_counts_the_runs_it_trained_again(tiny, trainer):
    study, runs, out, _ = tiny
    first_rung(study, runs, out)
    trainer()
    shutil.rmtree(runs)  # a fresh clone: H2 and H4 train again from step 0 to rung 6
    assert run_screens(study, runs, out) == 0 and len(trainer()) == 2
    c = screen_cpu(study, out, "a")  # 30 s to rung 3 on the first machine, then 60 s from step 0
    assert {n: round(h * 3600) for n, h in c["hours"].items()} == {W2: 30, W4: 30, H2: 90, H4: 90}
    assert screens_cost(study, out).startswith("; the screens: 0.07 CPU-hours more (")  # 240 s; before: 180 s


def _continued_by_the_second(tiny, trainer, tmp_path):
    """The first study to rung 3; the second takes its records and continues H2 and H4 from their
    checkpoints to rung 6 in the same run folders (one machine)."""
    study, runs, out, _ = tiny
    first_rung(study, runs, out)
    trainer()
    other, _, out2 = second(tmp_path)
    assert run_screens(other, runs, out2, records=tmp_path) == 0 and len(trainer()) == 2
    return study, out, other, out2


def test_a_run_continued_from_another_studys_rung_record_counts_only_the_steps_beyond_it(tiny, trainer, tmp_path):
    study, out, other, out2 = _continued_by_the_second(tiny, trainer, tmp_path)
    theirs = screen_cpu(other, out2, "a")  # H2, H4: 60 s each, of which 30 s to rung 3 are the first study's
    assert {n: round(h * 3600) for n, h in theirs["hours"].items()} == {H2: 30, H4: 30}  # before: 60 each
    assert theirs["continued_from"] == {H2: "st", H4: "st"} and set(theirs["shared"]) == {W2, W4}
    mine = screen_cpu(study, out, "a")
    assert sum(mine["hours"].values()) * 3600 + sum(theirs["hours"].values()) * 3600 == 180.0  # 4 x 30 + 2 x 30
    # the first study then takes the second's records of the runs it went on with: its own 30 s stay counted
    assert run_screens(study, tiny[1], out, records=tmp_path) == 0 and trainer() == []
    mine = screen_cpu(study, out, "a")
    assert {n: round(h * 3600) for n, h in mine["hours"].items()} == {W2: 30, W4: 30, H2: 30, H4: 30}
    assert set(mine["shared"]) == {H2, H4}  # before: 0 s for H2 and H4 (shared), the second study counting 60 each
    assert screens_cost(other, out2).startswith("; the screens: 0.02 CPU-hours more (")  # 60 s


def test_the_index_total_adds_each_studys_screens_counting_a_shared_run_once(tiny, trainer, tmp_path):
    # before: the index's total had no screen in it (only each README's Cost line did)
    study, out, other, out2 = _continued_by_the_second(tiny, trainer, tmp_path)
    for s, o in ((study, out), (other, out2)):
        _write_claims(s, {}, [], o, cost({}))
        data = json.loads((o / "claims.json").read_text())
        (o / "claims.json").write_text(json.dumps({**data, "budget": "full"}))  # the index lists full budgets
    table = "\n".join(cost_table(tmp_path))
    assert "| [st](out/) | 0 of 4 runs | — | 0.00 | 0.03 |" in table
    assert "| [st2](st2/) | 0 of 4 runs | — | 0.00 | 0.02 |" in table
    assert "| 0 runs | | **0.05** | 0.05 |" in table  # 180 s: each CPU second once
    assert json.loads((out / "claims.json").read_text())["cost"]["screens"]["hours"] * 3600 == 120.0


def test_a_shared_record_that_names_no_study_is_credited_to_its_holder():
    """Old code: credited to "?", a name no study claims, so its seconds fell out of every total."""
    from normlab.study.cpu_ledger import spent

    assert spent({"cpu_s": 90.0, "shared_from": {"record": "screen/a/x"}}, "mine") == [
        {"study": "mine", "cpu_s": 90.0, "redone": False}]
    assert spent({"cpu_s": 90.0, "shared_from": {"study": "other"}}, "mine")[0]["study"] == "other"
