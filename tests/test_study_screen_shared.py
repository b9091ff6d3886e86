"""A screen takes another study's rung records of the same run (study/screen_run.py): two studies that
screen the same arm at the same settings (deep_recent's pre-LN and post-LN are deep_bleu's) hold the
same runs (the same identity hash), so on a fresh clone (the run folders gone) the second study ranks
each setting from the first's rung record (<records>/<study>/screen/<arm>/<setting>/), trains nothing
for the settings those hold, copies each record into its own folder marked `shared_from`, and --status
agrees. A record of another identity is not taken. The runs are test_study_screen_records' fake
trainer (no model)."""
import json
import shutil
from pathlib import Path

from normlab.study.screen_run import run_screens, screen_jobs
from normlab.study.screen_status import screened_status_lines
from normlab.study.spec import load_study

from test_study_screen_records import trainer  # noqa: F401 (the fixture)
from test_study_screen_status import H2, H4, STUDY, W2, W4, flat, tiny  # noqa: F401 (tiny: the fixture)


def second(tmp_path):
    """Another study with the same screen of the same arm (its own name, folder and run folders)."""
    path = tmp_path / "st2.yaml"
    path.write_text(STUDY)
    study = load_study(str(path), "smoke")
    return study, tmp_path / "runs2", tmp_path / "st2"


def test_a_second_study_takes_the_first_studys_rung_records_on_a_fresh_clone(tiny, trainer, tmp_path, monkeypatch):
    study, runs, out, _ = tiny
    assert run_screens(study, runs, out) == 0  # the first study screens its arm: 4 settings to 3, 2 to 6
    assert len(trainer()) == 6
    shutil.rmtree(runs)  # a fresh clone: the committed records only
    other, runs2, out2 = second(tmp_path)
    jobs = screen_jobs(other, other.arms["a"], runs2, out2, [W2, W4, H2, H4], 3)
    mine = screen_jobs(study, study.arms["a"], runs, out, [W2, W4, H2, H4], 3)
    assert {n: j.identity_hash for n, j in jobs.items()} == {n: j.identity_hash for n, j in mine.items()}
    # --status reads the first study's records as the run would: every rung ranked, nothing to train
    lines = screened_status_lines(other, runs2, out2, tmp_path)
    assert lines[1] == "screen a, every rung ranked; the choice is written when the study next runs: 3 left, 1 chosen"
    assert flat(lines[2]) == f"{W2} left at rung 3: valid_loss 6.500"
    assert flat(lines[4]) == f"{H2} chosen at rung 6: valid_loss -1.000; its run is the arm's seed 1"
    globs, glob = [], Path.glob  # every study's rung records are looked up once a command, not per job
    with monkeypatch.context() as m:
        m.setattr(Path, "glob", lambda self, pattern, *a, **k: globs.append(pattern) or glob(self, pattern, *a, **k))
        assert run_screens(other, runs2, out2, records=tmp_path) == 0
    assert globs.count("*/screen/*/*/results.json") == 1
    assert trainer() == []  # nothing trained: every setting ranked from the first study's rung records
    theirs, ours = (json.loads((o / "screen" / "a.json").read_text()) for o in (out, out2))
    assert ours == theirs and ours["chosen"] == H2
    for name, job in jobs.items():  # each record copied into the second study's folder, marked where from
        res = json.loads((job.record / "results.json").read_text())
        src = json.loads((mine[name].record / "results.json").read_text())
        assert res["shared_from"] == {"study": "out", "record": f"screen/a/{name}"}
        assert res["identity_hash"] == job.identity_hash and res["steps"] == src["steps"] == src["rung"]
        assert res["study"]["name"] == "st2" and res["cpu_s"] == src["cpu_s"]
        assert (job.record / "metrics.csv").read_text() == (mine[name].record / "metrics.csv").read_text()
    # the screen again (its choice file gone) ranks from its own copies: nothing trained or copied again
    (out2 / "screen" / "a.json").unlink()
    copies = {n: (j.record / "results.json").read_text() for n, j in jobs.items()}
    shutil.rmtree(out)  # the first study's records gone too
    assert run_screens(other, runs2, out2, records=tmp_path) == 0 and trainer() == []
    assert {n: (j.record / "results.json").read_text() for n, j in jobs.items()} == copies
    assert json.loads((out2 / "screen" / "a.json").read_text()) == ours


def test_a_rung_record_of_another_identity_in_another_study_is_not_taken(tiny, trainer, tmp_path):
    study, runs, out, _ = tiny
    jobs = screen_jobs(study, study.arms["a"], runs, out, [W2, W4, H2, H4], 3)
    assert run_screens(study, runs, out) == 0
    trainer()
    shutil.rmtree(runs)
    for name in (W4, H4):  # the first study's records of these two: another run (its grid or arm as it was)
        path = jobs[name].record / "results.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "identity_hash": "0" * 16}))
    other, runs2, out2 = second(tmp_path)
    lines = screened_status_lines(other, runs2, out2, tmp_path)
    assert lines[1] == "screen a, at rung 3: 2 at rung, 2 not started"
    assert [flat(line).split()[1:] for line in lines[2:6]] == [["at", "rung", "3:", "valid_loss", "6.500"],
                                                                ["not", "started"],
                                                                ["at", "rung", "3:", "valid_loss", "3.500"],
                                                                ["not", "started"]]
    assert run_screens(other, runs2, out2, records=tmp_path) == 0
    trained = trainer()
    assert sorted(trained[:2]) == sorted((jobs[n].run_dir.name, 0, 3) for n in (W4, H4))  # trained: not taken
    assert trained[2:] == [(jobs[H4].run_dir.name, 3, 6)]  # H2's rung-6 record is the first study's
    for name in (W4, H4):  # its own record, of today's identity, not marked shared
        res = json.loads(((out2 / "screen" / "a" / name) / "results.json").read_text())
        assert res["identity_hash"] == jobs[name].identity_hash and "shared_from" not in res
    assert json.loads((out2 / "screen" / "a" / W2 / "results.json").read_text())["shared_from"]["study"] == "out"


def test_a_second_study_on_the_same_run_folders_counts_the_runs_as_the_firsts(tiny, trainer, tmp_path):
    """One machine, one pool of run folders (the full budget's studies/runs): the second study finds the
    first's runs in their folders at each rung and copies the first's records (shared_from), so the
    CPU time of each run is counted once, in the study that trained it."""
    study, runs, out, _ = tiny
    assert run_screens(study, runs, out) == 0 and len(trainer()) == 6
    other, _, out2 = second(tmp_path)
    assert run_screens(other, runs, out2, records=tmp_path) == 0
    assert trainer() == []
    for name, job in screen_jobs(other, other.arms["a"], runs, out2, [W2, W4, H2, H4], 3).items():
        res = json.loads((job.record / "results.json").read_text())
        assert res["shared_from"] == {"study": "out", "record": f"screen/a/{name}"}, name


def _taken_further_by_the_second(tiny, trainer, tmp_path, same_pool: bool):
    """The first study to rung 3; the second takes its records and trains the kept settings on to rung 6,
    on the same run folders or on a copy (another machine); the first runs its screen again."""
    from test_study_screen_records import first_rung
    study, runs, out, _ = tiny
    first_rung(study, runs, out)
    assert len(trainer()) == 4
    other, _, out2 = second(tmp_path)
    runs2 = runs if same_pool else tmp_path / "runs_x"
    if not same_pool:
        shutil.copytree(runs, runs2)
    assert run_screens(other, runs2, out2, records=tmp_path) == 0 and len(trainer()) == 2  # H2, H4: 3 -> 6
    assert run_screens(study, runs, out, records=tmp_path) == 0
    assert trainer() == []  # nothing trained again
    for name in (H2, H4):  # the second study's records of the runs it took on: copied, counted there
        res = json.loads((out / "screen" / "a" / name / "results.json").read_text())
        assert (res["shared_from"], res["steps"]) == ({"study": "st2", "record": f"screen/a/{name}"}, 6), name


def test_runs_another_study_took_further_in_the_same_run_folders_are_its_records(tiny, trainer, tmp_path):
    _taken_further_by_the_second(tiny, trainer, tmp_path, same_pool=True)


def test_a_stale_run_folder_gives_way_to_another_studys_record_that_went_further(tiny, trainer, tmp_path):
    _taken_further_by_the_second(tiny, trainer, tmp_path, same_pool=False)
