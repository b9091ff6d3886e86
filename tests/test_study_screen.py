"""Each arm at its own regime, chosen on validation by successive halving (study/screen.py,
screen_run.py; issues 35 and 36): the grid, the ranking, the rules of the study file, and a smoke
study whose screened arm runs its seeds at the setting its screen chose, continuing the screen's run."""
import json

import pytest

from normlab.errors import UserError
from normlab.study.screen import Screen, load_screen, rank, ranked_value, rung_value, setting_name, setting_overrides

from study_files import write_study_file
from test_study import run_study


def test_the_grid_its_names_and_how_many_go_on():
    s = load_screen({"grid": {"optim.lr": [5e-4, 1e-3, 3e-3], "optim.warmup": [150, 1000]}, "rungs": [250, 1000]},
                    "s.yaml", [1, 2])
    assert s == Screen((("optim.lr", (5e-4, 1e-3, 3e-3)), ("optim.warmup", (150, 1000))), (250, 1000), 0.25, 1)
    first = s.settings()[0]
    assert len(s.settings()) == 6 and first == {"optim.lr": 5e-4, "optim.warmup": 150}
    assert s.settings()[1] == {"optim.lr": 5e-4, "optim.warmup": 1000}  # the first key varies slowest
    assert setting_name(first) == "lr0.0005-warmup150" and setting_overrides(first) == ["optim.lr=0.0005", "optim.warmup=150"]
    assert [s.kept(8, 0), s.kept(3, 0), s.kept(2, 1)] == [2, 1, 1]  # ceil(8 x 0.25); at least 1; one after the last


def test_ranking_drops_what_has_no_value_and_keeps_the_grid_order_on_ties():
    values = {"a": 4.0, "b": None, "c": 3.5, "d": 3.5}
    assert rank(values, "valid_loss") == ["c", "d", "a"]
    assert rank({"a": 10.0, "b": 12.0}, "valid_bleu") == ["b", "a"]  # higher is better


def test_the_rung_value_is_the_validation_logged_at_that_optimizer_step(tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "metrics.csv").write_text(
        "epoch,step,train/loss,valid/loss,valid/bleu\n0,248,5.0,,\n0,249,,4.5,3.0\n0,499,,nan,\n")
    assert rung_value(tmp_path, 250, "valid_loss") == 4.5 and rung_value(tmp_path, 250, "valid_bleu") == 3.0
    assert rung_value(tmp_path, 500, "valid_loss") is None and rung_value(tmp_path, 750, "valid_loss") is None
    assert rung_value(tmp_path / "none", 250, "valid_loss") is None


def test_a_run_that_stopped_at_its_plateau_before_the_rung_is_ranked_by_its_last_validation(tmp_path):
    """It had no value at the rung and was dropped as a diverged run: a converged run stands at its last
    validation; a diverged or stalled one (not `completed`) still has none."""
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "metrics.csv").write_text(
        "epoch,step,train/loss,valid/loss\n0,249,,4.5\n0,499,,4.2\n0,599,,4.19\n")
    assert rung_value(tmp_path, 1000, "valid_loss") is None
    assert ranked_value(tmp_path, 1000, "valid_loss", "completed") == 4.19  # its last, at step 600
    assert ranked_value(tmp_path, 500, "valid_loss", "completed") == 4.2  # a value at the rung: that one
    assert ranked_value(tmp_path, 1000, "valid_loss", "diverged") is None
    assert ranked_value(tmp_path, 1000, "valid_loss", "stalled") is None
    (tmp_path / "csv" / "metrics.csv").write_text("epoch,step,train/loss,valid/loss\n0,249,,4.5\n0,599,,nan\n")
    assert ranked_value(tmp_path, 1000, "valid_loss", "completed") is None  # its last validation not finite


@pytest.mark.parametrize("node, key", [
    ({"grid": {}, "rungs": [1]}, "screen.grid"), ({"grid": {"optim.lr": 1e-3}, "rungs": [1]}, "screen.grid"),
    ({"grid": {"optim.lr": [1e-3]}, "rungs": [4, 2]}, "screen.rungs"),
    ({"grid": {"optim.lr": [1e-3]}, "rungs": [2], "keep": 0}, "screen.keep"),
    ({"grid": {"optim.lr": [1e-3]}, "rungs": [2], "seed": 7}, "screen.seed"),
    ({"grid": {"optim.lr": [1e-3]}, "rungs": [2], "by": "test_bleu"}, "screen.by"),
    ({"grid": {"optim.lr": [1e-3]}, "rungs": [2], "rung": [3]}, "screen.rung")])
def test_a_bad_screen_is_one_line_naming_the_key(node, key):
    with pytest.raises(UserError, match=rf"s\.yaml: {key}"):
        load_screen(node, "s.yaml", [1, 2])


SCREEN = """screen:
  grid: {optim.lr: [0.001, 0.003], optim.warmup: [2, 4]}
  rungs: [3]
  keep: 0.5
"""


@pytest.mark.integration
@pytest.mark.slow  # 8 training processes: ~3 min alone, 7 under load
def test_a_smoke_study_screens_an_arm_and_runs_its_seeds_at_the_choice(tmp_path):
    path = write_study_file(tmp_path, [], arms={"a": ["norm=prenorm"], "b1": ["norm=postnorm"], "b2": ["norm=postnorm"]},
                            extra=SCREEN)
    text = path.read_text().replace("  b1: {overrides: [norm=postnorm]}", "  b1: {overrides: [norm=postnorm], screen: false}")
    text = text.replace("  b2: {overrides: [norm=postnorm]}\n", "").replace("  b_best: {arms: [b1, b2], by: valid_bleu}\n", "")
    path.write_text(text.replace("best_of:\n", ""))
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = [str(path), "study.budget=smoke", "--out", str(out), "--runs", str(runs), "--jobs", "1"]
    r = run_study(args, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    choice = json.loads((out / "screen" / "a.json").read_text())
    rows = {row["name"]: row for row in choice["settings"]}
    assert list(rows) == ["lr0.001-warmup2", "lr0.001-warmup4", "lr0.003-warmup2", "lr0.003-warmup4"]
    values = {n: row["values"]["3"] for n, row in rows.items()}
    assert all(isinstance(v, float) for v in values.values())
    assert choice["chosen"] == min(values, key=values.get)  # the lowest valid loss at the rung
    assert sorted(n for n, row in rows.items() if row["dropped_at"] == 3) == sorted(set(rows) - {choice["chosen"]})
    assert not (out / "screen" / "b1.json").exists()
    for name in rows:  # each setting's rung record, committed with the choice (a fresh clone continues from it)
        rec = json.loads((out / "screen" / "a" / name / "results.json").read_text())
        assert (rec["rung"], rec["steps"], rec["status"]) == (3, 3, "stopped") and rec["identity_hash"]
        assert sorted(p.name for p in (out / "screen" / "a" / name).iterdir()) == ["metrics.csv", "results.json"]
    # the screened arm's seeds run at the chosen setting; seed 1 is the screen's run, continued
    chosen = dict(o.split("=") for o in rows[choice["chosen"]]["overrides"])
    screen_runs = {p.name for p in runs.iterdir() if p.is_dir()}
    for seed in (1, 2):
        res = json.loads((out / "runs" / f"a-s{seed}" / "results.json").read_text())
        assert res["status"] == "completed" and res["steps"] == 6
        assert {o.split("=")[0]: o.split("=")[1] for o in res["study"]["overrides"] if o.split("=")[0] in chosen} == chosen
    s1 = json.loads((out / "runs" / "a-s1" / "results.json").read_text())
    assert [leg["from_step"] for leg in s1["code_legs"]] == [0, 3]  # trained to the rung, then on
    assert s1["study"]["run_dir"].rsplit("/", 1)[-1] in screen_runs
    dropped = [json.loads((runs / p / "results.json").read_text()) for p in screen_runs
               if (runs / p / "results.json").is_file()]
    assert sorted((d["status"], d["steps"]) for d in dropped if d["status"] == "stopped") == [("stopped", 3)] * 3
    assert json.loads((out / "runs" / "b1-s1" / "results.json").read_text())["status"] == "completed"
    # the same command again: everything is decided and recorded
    again = run_study(args, timeout=600)
    assert again.returncode == 0 and "start " not in again.stdout, again.stdout[-2000:]


def test_the_readme_shows_each_screen_its_cost_and_the_sensitivity_plot(tmp_path):
    from normlab.study.screen import Screen, write_choice
    from normlab.study.screen_report import screen_lines
    from normlab.study.spec import load_study

    path = write_study_file(tmp_path, [], extra=SCREEN.replace("rungs: [3]", "rungs: [250, 1000]"))
    study = load_study(str(path))
    out = tmp_path / "out"
    rows = [{"name": n, "overrides": [f"optim.lr={lr}", f"optim.warmup={wu}"], "values": v, "status": st, "dropped_at": d}
            for n, lr, wu, v, st, d in [
                ("lr0.001-warmup2", 0.001, 2, {"250": 5.1, "1000": 4.2}, "stopped", None),
                ("lr0.001-warmup4", 0.001, 4, {"250": 5.3}, "stopped", 250),
                ("lr0.003-warmup2", 0.003, 2, {"250": None}, "diverged", 250),
                ("lr0.003-warmup4", 0.003, 4, {"250": 5.0, "1000": 4.4}, "stopped", 1000)]]
    write_choice(out / "screen" / "a.json", "a", study.screen, rows, "lr0.001-warmup2")
    text = "\n".join(screen_lines(study, out, 2000))
    assert "chosen `optim.lr=0.001 optim.warmup=2`; the screen trained 1,500 steps beyond the chosen run (0.75 runs" in text
    assert "| **lr0.001-warmup2** | 5.100 | 4.200 | chosen |" in text
    assert "| lr0.003-warmup2 | — | — | 250 (diverged) |" in text and "| lr0.003-warmup4 | 5.000 | 4.400 | 1000 |" in text
    assert "![valid_loss against the learning rate, per arm](screen.png)" in text and (out / "screen.png").stat().st_size > 0
    assert isinstance(study.screen, Screen) and screen_lines(load_study(str(write_study_file(tmp_path / "n", []))), out, 2000) == []


def test_a_screened_arm_is_planned_only_at_its_chosen_setting(tmp_path):
    """plan() leaves a screened arm out until its screen has chosen (no seed runs at an untuned regime),
    then runs every seed of it at the chosen overrides; an arm with `screen: false` is planned at once."""
    from normlab.study.plan import plan
    from normlab.study.spec import load_study

    path = write_study_file(tmp_path, [], arms={"a": ["norm=prenorm"], "b1": ["norm=postnorm"]}, extra=SCREEN)
    path.write_text(path.read_text().replace("  b1: {overrides: [norm=postnorm]}",
                                             "  b1: {overrides: [norm=postnorm], screen: false}")
                    .replace("  b_best: {arms: [b1, b2], by: valid_bleu}\n", "").replace("best_of:\n", ""))
    study = load_study(str(path), "smoke")
    waiting = plan(study, tmp_path / "runs", tmp_path / "out")
    assert sorted((j.arm.name, j.seed) for j in waiting) == [("b1", 1), ("b1", 2)]  # smoke: 2 seeds
    jobs = plan(study, tmp_path / "runs", tmp_path / "out", {"a": ["optim.lr=0.003", "optim.warmup=4"]})
    chosen = [j for j in jobs if j.arm.name == "a"]
    assert [j.seed for j in chosen] == [1, 2]
    assert all(j.overrides[-2:] == ["optim.lr=0.003", "optim.warmup=4"] for j in chosen)
    assert len({j.identity_hash for j in jobs}) == 4
