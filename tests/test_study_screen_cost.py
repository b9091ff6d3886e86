"""A screen's cost in CPU time in the study README (issue 36; study/screen_report.py): each screened
arm's line in the Screens section sums its settings' `cpu_s` at the last rung each reached, from the
rung records, says "not recorded" for a record without it, and the Cost line adds the screens' CPU-hours
beyond the seed records (a chosen run continued as seed 1 counted once, in its seed's record). The runs
are test_study_screen_records' fake trainer (no model)."""
import json
import shutil

from normlab.study.readme import _cost_lines, cost
from normlab.study.screen_report import screen_lines, screens_cost
from normlab.study.screen_run import run_screens, screen_jobs

from test_study_screen_records import trainer  # noqa: F401 (the fixture)
from test_study_screen_shared import second
from test_study_screen_status import H2, H4, W2, W4, tiny  # noqa: F401 (tiny: the fixture)


def set_cpu(job, cpu_s):
    """The rung record's cpu_s (None: a record without it, a run from before runs counted it), as a
    record from before `cpu_spent` (cpu_ledger: such a record stands for its cpu_s)."""
    path = job.record / "results.json"
    res = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("cpu_s", "cpu_spent")}
    path.write_text(json.dumps(res if cpu_s is None else {**res, "cpu_s": cpu_s}))


def test_the_readme_gives_each_screens_cpu_hours_from_its_rung_records(tiny, trainer):
    study, runs, out, _ = tiny
    jobs = screen_jobs(study, study.arms["a"], runs, out, [W2, W4, H2, H4], 3)
    assert run_screens(study, runs, out) == 0 and len(trainer()) == 6
    assert json.loads((out / "screen" / "a.json").read_text())["chosen"] == H2
    for name, cpu in ((W2, 1800.0), (W4, None), (H2, 3600.0), (H4, 5400.0)):  # W4: not recorded
        set_cpu(jobs[name], cpu)
    text = "\n".join(screen_lines(study, out, 12))
    assert ("the screen trained 12 steps beyond the chosen run (1.00 runs of 12 steps); its settings' runs used "
            "3.00 CPU-hours to where each left (3 runs; 2.00 beyond the chosen run); CPU time not recorded for "
            f"{W4} (no rung record with `cpu_s`)." in text)
    assert screens_cost(study, out) == ("; the screens: 3.00 CPU-hours more (the settings' runs to where each left, "
                                        "from their rung records; a chosen run continued as a seed counted once, in "
                                        "its seed's record; not recorded for 1 of 4 settings' runs)")
    # the chosen run continued as seed 1 (the same identity): its CPU time is in its seed record, counted once
    seed = out / "runs" / "a-s1"
    seed.mkdir(parents=True)
    (seed / "results.json").write_text(json.dumps({"status": "completed", "steps": 12, "cpu_s": 9000.0, "study": {
        "seed": 1}, "identity_hash": jobs[H2].identity_hash}))
    assert "(3 runs; 2.00 beyond the chosen run, whose seed 1 record counts it whole)" in "\n".join(
        screen_lines(study, out, 12))
    assert screens_cost(study, out).startswith("; the screens: 2.00 CPU-hours more (")
    # with code legs: the seed continued the screen's run where its rung record stopped (step 6)...
    rung = jobs[H2].record / "results.json"
    legs = [{"from_step": 0, "commit": "c1", "dirty": False}]
    rung.write_text(json.dumps({**json.loads(rung.read_text()), "code_legs": legs}))
    seed_res = json.loads((seed / "results.json").read_text())
    (seed / "results.json").write_text(json.dumps({**seed_res, "code_legs": [*legs, {**legs[0], "from_step": 6}]}))
    assert screens_cost(study, out).startswith("; the screens: 2.00 CPU-hours more (")
    # ...or was trained again from step 0 on a fresh clone (one leg from 0, at the same commit, with far more
    # CPU than the screen's run): the screen's run was spent elsewhere, so the screen counts it (before: counted
    # nowhere)
    (seed / "results.json").write_text(json.dumps({**seed_res, "code_legs": legs}))
    assert screens_cost(study, out).startswith("; the screens: 3.00 CPU-hours more (")
    (seed / "results.json").write_text(json.dumps(seed_res))
    line = _cost_lines(study, cost({}), out)[2]
    assert line.endswith("; the screens: 2.00 CPU-hours more (the settings' runs to where each left, from their rung "
                         "records; a chosen run continued as a seed counted once, in its seed's record; not recorded "
                         "for 1 of 4 settings' runs).")
    for job in jobs.values():  # no record holds cpu_s: not recorded, not guessed
        set_cpu(job, None)
    assert screens_cost(study, out) == "; the screens: CPU time not recorded (no rung record with `cpu_s`)"
    assert (f"; CPU time not recorded for {W2}, {W4}, {H2}, {H4} (no rung record with `cpu_s`)."
            in "\n".join(screen_lines(study, out, 12)))


def test_a_screen_taken_from_another_studys_rung_records_counts_their_cpu_time_there(tiny, trainer, tmp_path):
    study, runs, out, _ = tiny
    assert run_screens(study, runs, out) == 0
    trainer()
    shutil.rmtree(runs)
    other, runs2, out2 = second(tmp_path)
    assert run_screens(other, runs2, out2, records=tmp_path) == 0 and trainer() == []
    assert ("; 4 settings' runs shared with out (the same runs, trained once; their CPU-hours are counted there)."
            in "\n".join(screen_lines(other, out2, 12)))
    assert screens_cost(other, out2).endswith("; 4 shared with another study, counted there)")
    assert screens_cost(other, out2).startswith("; the screens: 0.00 CPU-hours more (")
    assert screens_cost(study, out).startswith("; the screens: 0.05 CPU-hours more (")  # 30+30+60+60 CPU s
