"""A damaged screen file never chooses: a rung record whose metrics.csv is cut off, emptied or holds a
bad cell is no record (named once; the setting trains again rather than be ranked out as if it had
diverged), and a damaged choice file (<out>/screen/<arm>.json) is named once and not taken by the
status, the report or the outcome claims, while the screen refuses to run over it (one line, the file
left as it is). The runs are the fake trainer of test_study_screen_records.py."""
import json
import shutil

import pytest

from normlab.errors import UserError
from normlab.study.screen import read_choice, read_screen, setting_name
from normlab.study.screen_outcome import load_screens
from normlab.study.screen_report import screen_data
from normlab.study.screen_run import choices, run_screens
from normlab.study.screen_status import setting_state

from test_study_screen_records import first_rung, trainer  # noqa: F401 (trainer: the fixture)
from test_study_screen_status import H2, H4, W2, W4, tiny  # noqa: F401 (tiny: the fixture)

DAMAGE = {
    "cut off": lambda text: text[:len(text.splitlines()[0]) + 3],  # the header and part of a row
    "emptied": lambda text: "",
    "a bad cell": lambda text: text.replace("\n0,2,", "\n0,abc2,", 1),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_rung_record_with_damaged_metrics_trains_again_and_is_named(tiny, trainer, damage, capsys):
    """The old code ranked the setting from the damaged file, found no value and dropped it (silently,
    for a cut-off or empty file), even when it was the best setting."""
    study, runs, out, _ = tiny
    jobs = first_rung(study, runs, out)
    trainer()
    shutil.rmtree(runs)  # a fresh clone: only the records
    metrics = jobs[H2].record / "metrics.csv"
    metrics.write_text(DAMAGE[damage](metrics.read_text()))
    capsys.readouterr()
    assert [setting_state(jobs[n], 3, "valid_loss").state for n in (W2, W4, H2, H4)] == [
        "at rung", "at rung", "not started", "at rung"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {metrics}: "), err
    assert any(what in err[0] for what in ("no validation logged at step 3", "'abc2' is not an integer")), err
    first_rung(study, runs, out)
    assert trainer() == [(jobs[H2].run_dir.name, 0, 3)]  # trained again, the others ranked from their records


def write_choice_file(out, text):
    path = out / "screen" / "a.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def good_choice(study):
    names = [setting_name(s) for s in study.screen.settings()]
    rows = [{"name": n, "overrides": [f"optim.lr={n}"], "values": {"3": 5.0, "6": 4.0}, "status": "stopped",
             "dropped_at": None if n == names[0] else 3, "floor": 7.0} for n in names]
    return {"arm": "a", "by": "valid_loss", "rungs": [3, 6], "keep": 0.5, "seed": 1, "settings": rows,
            "chosen": names[0]}


def damaged_choices(study):
    good = good_choice(study)
    row = good["settings"][1]
    return {
        "garbage": "{garbage",
        "a list": "[]",
        "chosen a list": json.dumps({**good, "chosen": ["x"]}),
        "settings a number": json.dumps({**good, "settings": 5}),
        "chosen no setting": json.dumps({**good, "chosen": "lr9-warmup9"}),
        "no dropped_at": json.dumps({**good, "settings": [*good["settings"][:1],
                                                           {k: v for k, v in row.items() if k != "dropped_at"}]}),
        "a value not a number": json.dumps({**good, "settings": [*good["settings"][:1], {**row, "values": {"3": "abc"}}]}),
        "a step not a step": json.dumps({**good, "settings": [*good["settings"][:1], {**row, "values": {"abc": 1.0}}]}),
        "floor not a number": json.dumps({**good, "settings": [*good["settings"][:1], {**row, "floor": "abc"}]}),
        "an override without =": json.dumps({**good, "settings": [*good["settings"][:1],
                                                                  {**row, "overrides": ["optim.lr"]}]}),
    }


def test_a_good_choice_is_taken_and_one_on_another_grid_is_not(tiny):
    study, runs, out, _ = tiny
    good = good_choice(study)
    path = write_choice_file(out, json.dumps(good))
    grid = [r["name"] for r in good["settings"]]
    assert read_choice(path, grid) == good and list(choices(study, out)) == ["a"]
    other = {**good, "settings": good["settings"][::-1]}  # another grid (its order): not taken anywhere
    write_choice_file(out, json.dumps(other))
    assert choices(study, out) == {} and screen_data(study, out) == {} and load_screens(study, out) == {}
    assert read_screen(path) == other  # read, where no grid is asked for


@pytest.mark.parametrize("case", ["garbage", "a list", "chosen a list", "settings a number", "chosen no setting",
                                  "no dropped_at", "a value not a number", "a step not a step",
                                  "floor not a number", "an override without =", "a folder"])
def test_a_damaged_choice_file_is_named_once_and_the_screen_refuses_to_run_over_it(tiny, case, capsys):
    """The old code: a TypeError, KeyError, ValueError or StopIteration traceback in --status or
    --report-only for most of these, and the study run silently replaced a garbage file (or crashed on
    a folder, leaving a .tmp file)."""
    study, runs, out, _ = tiny
    path = out / "screen" / "a.json"
    if case == "a folder":
        path.mkdir(parents=True)
    else:
        write_choice_file(out, damaged_choices(study)[case])
    before = path.read_bytes() if path.is_file() else None
    capsys.readouterr()
    assert choices(study, out) == {} and screen_data(study, out) == {} and load_screens(study, out) == {}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {path}: ") and "treated as not decided" in err[0], err
    with pytest.raises(UserError) as e:
        run_screens(study, runs, out)
    assert str(e.value).startswith(f"{path}: ") and "move it away" in str(e.value) and "\n" not in str(e.value)
    assert (path.read_bytes() if path.is_file() else None) == before and path.exists()
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]  # nothing written beside it
    assert not runs.exists()  # nothing trained


@pytest.mark.parametrize("where", ["screen", "screen/a"])
def test_a_file_where_the_screens_folder_should_be_is_refused_in_one_line(tiny, trainer, where):
    """The old code trained every setting and failed at its first record (a traceback after the runs)."""
    study, runs, out, _ = tiny
    path = out / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    with pytest.raises(UserError) as e:
        run_screens(study, runs, out)
    assert str(e.value) == f"{path}: a file where the screen's folder should be (move it away)"
    assert path.read_text() == "x" and not runs.exists() and trainer() == []


def test_a_nan_validation_at_the_rung_and_a_plateau_before_it_are_records_not_damage(tiny, trainer, capsys):
    """A validation logged as nan is logged (ranked as no value, as rung_value does), not a cut-off file;
    a run completed at its plateau before a rung is ranked from its last validation."""
    from normlab.study.screen_run import rung_record

    study, runs, out, _ = tiny
    jobs = first_rung(study, runs, out)
    trainer()
    shutil.rmtree(runs)
    metrics = jobs[H2].record / "metrics.csv"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:-1] + [",".join(lines[-1].split(",")[:-1] + ["nan"])]) + "\n")
    capsys.readouterr()
    assert rung_record(jobs[H2], 3) is not None and capsys.readouterr().err == ""
    first_rung(study, runs, out)
    assert trainer() == []  # nothing trained again
    res = json.loads((jobs[W2].record / "results.json").read_text())
    (jobs[W2].record / "results.json").write_text(json.dumps({**res, "status": "completed"}))  # its plateau at 3
    assert rung_record(jobs[W2], 6) is not None  # ranked at rung 6 from its validation at step 3
    assert capsys.readouterr().err == ""
