"""Outcome claims judged on the learning-rate screens (study/screen_outcome.py, issue 35 item 4):
"fails" holds when an arm failed at every setting of its screen; "X trains where post-LN fails" needs
X to train at the settings where post-LN diverged or stalled."""
import json

import pytest

from normlab.errors import UserError
from normlab.study.claims import judge
from normlab.study.records import load_records
from normlab.study.screen_outcome import failed, fails_on_screen, load_screens, where_fails
from normlab.study.spec import load_study

from study_files import record, write_study_file

GRID = ["lr0.001-warmup150", "lr0.003-warmup150", "lr0.003-warmup1000"]


def screen(values: dict, statuses: dict | None = None, chosen="auto", floor=6.5) -> dict:
    """A screen record as screen_run writes it: {setting: its value at the first rung (None: none)}."""
    statuses = statuses or {}
    rows = [{"name": n, "overrides": [], "values": {"500": v}, "status": statuses.get(n, "stopped" if v else "stalled"),
             "dropped_at": 500, "floor": floor} for n, v in values.items()]
    scored = {n: v for n, v in values.items() if v is not None}
    pick = (min(scored, key=scored.get) if scored else None) if chosen == "auto" else chosen
    return {"arm": "x", "by": "valid_loss", "rungs": [500, 1000], "keep": 0.25, "seed": 1, "settings": rows, "chosen": pick}


def test_a_setting_fails_when_it_diverged_stalled_or_ended_at_the_floor():
    s = screen({GRID[0]: 5.1, GRID[1]: None, GRID[2]: 4.8}, {GRID[2]: "diverged"})
    assert [r["name"] for r in s["settings"] if failed(r)] == [GRID[1], GRID[2]]  # a diverged run's value does not count
    assert fails_on_screen(s) == (False, "its screen: diverged, stalled or at the floor at 2 of 3 settings, "
                                         f"trained at {GRID[0]}")
    # a stall the guard had no time to flag (warmup 1,000 at the rung 500): its value is at the floor
    # (above L* - 0.25); the last rung a setting reached decides
    at_floor = screen({GRID[0]: 6.3, GRID[1]: 6.2, GRID[2]: None})
    at_floor["settings"][1]["values"]["1000"] = 6.26
    assert [failed(r) for r in at_floor["settings"]] == [True, True, True]
    assert fails_on_screen(at_floor) == (True, "diverged, stalled or at the floor at every setting of its screen (3 of 3)")
    at_floor["settings"][1]["values"]["1000"] = 6.2
    assert not failed(at_floor["settings"][1])
    # a row whose run left no status (the screen still running): nothing is judged on it
    running = screen(dict.fromkeys(GRID), {GRID[0]: None})
    assert fails_on_screen(running) == (False, "its screen is not complete")
    assert fails_on_screen(None) == (False, "")


def test_trains_where_the_other_fails_is_judged_on_the_settings_where_it_failed():
    post = screen({GRID[0]: 6.0, GRID[1]: None, GRID[2]: 6.4})  # trains at the lowest lr, stalls, sits at the floor
    where = f"where post_ln diverged, stalled or stayed at the floor ({GRID[1]}, {GRID[2]}), admin trained at"
    assert where_fails("admin", screen({GRID[0]: 5.0, GRID[1]: 4.5, GRID[2]: 4.4}), "post_ln", post) == (
        "held", f"{where} 2 of 2")
    part, line = where_fails("admin", screen({GRID[0]: 5.0, GRID[1]: 4.5, GRID[2]: 6.45}), "post_ln", post)
    assert (part, line) == ("inconclusive", f"{where} 1 of 2 ({GRID[1]})")  # admin at the floor where post-LN is
    assert where_fails("admin", screen({GRID[0]: 5.0, GRID[1]: None, GRID[2]: None}), "post_ln", post)[0] == "contradicted"
    everywhere = screen({GRID[0]: 6.0, GRID[1]: 5.9, GRID[2]: 5.8})
    assert where_fails("admin", everywhere, "post_ln", everywhere) == (
        None, "post_ln trained at every setting of its screen: 'where post_ln fails' is untested here")
    assert where_fails("admin", None, "post_ln", post)[0] is None
    assert where_fails("admin", everywhere, "post_ln", screen(dict.fromkeys(GRID), {GRID[0]: None}))[0] is None


CLAIMS = [{"id": "f", "claim": "B fails", "source": "s", "paper": "p", "kind": "fails", "better": "b1"},
          {"id": "t", "claim": "A trains where B fails", "source": "s", "paper": "p", "kind": "trains", "better": "a",
           "where_fails": "b1"}]
SCREEN = "screen:\n  grid: {optim.lr: [0.001, 0.003]}\n  rungs: [500]\n"


def test_the_verdicts_read_the_screens_the_study_wrote(tmp_path):
    path = write_study_file(tmp_path, CLAIMS, extra=SCREEN)
    study = load_study(str(path))
    out = tmp_path / "out"
    for seed in (1, 2, 3):
        record(out, "a", seed, test_bleu=20.0, valid_bleu=18.0)
    (out / "screen").mkdir(parents=True)
    (out / "screen" / "a.json").write_text(json.dumps(screen({"lr0.001": 5.0, "lr0.003": 4.6})))
    (out / "screen" / "b1.json").write_text(json.dumps(screen({"lr0.001": None, "lr0.003": None})))  # nothing chosen
    screens = load_screens(study, out)
    assert set(screens) == {"a", "b1"} and screens["b1"]["chosen"] is None
    v = {x.claim.id: x for x in judge(study, load_records(out), None, screens)}
    # b1 never ran a seed (its screen chose nothing): the fails claim holds on the screen alone
    assert v["f"].verdict == "held" and "every setting of its screen (2 of 2)" in v["f"].note
    assert v["t"].verdict == "held" and "a trained at 2 of 2" in v["t"].note
    # without the screens (an unscreened study) the same records say: fails not run, trains held
    plain = {x.claim.id: x.verdict for x in judge(study, load_records(out), None)}
    assert plain == {"f": "not run", "t": "held"}
    # a trains part that fails on the screen turns the held verdict into contradicted
    (out / "screen" / "a.json").write_text(json.dumps(screen({"lr0.001": None, "lr0.003": None}, chosen=None)))
    v = {x.claim.id: x for x in judge(study, load_records(out), None, load_screens(study, out))}
    assert v["t"].verdict == "contradicted"


def test_only_a_complete_screen_on_todays_grid_of_a_screened_arm_counts(tmp_path):
    path = write_study_file(tmp_path, CLAIMS, extra=SCREEN)
    out = tmp_path / "out"
    for seed in (1, 2, 3):
        record(out, "b1", seed, test_bleu=20.0, valid_bleu=18.0)  # b1's seeds trained
    (out / "screen").mkdir(parents=True)
    failing = screen({"lr0.001": None, "lr0.003": None}, chosen=None)
    (out / "screen" / "b1.json").write_text(json.dumps(failing))
    study = load_study(str(path))
    # seeds that completed beside a screen that failed everywhere: not held, both said
    v = {x.claim.id: x for x in judge(study, load_records(out), None, load_screens(study, out))}
    assert v["f"].verdict == "inconclusive" and "every setting" in v["f"].note
    # a screen of another grid (the study's grid has grown since) is not today's: not read
    path.write_text(path.read_text().replace("[0.001, 0.003]", "[0.001, 0.002, 0.003]"))
    assert load_screens(load_study(str(path)), out) == {}
    # nor is the screen of an arm that is no longer screened
    path.write_text(path.read_text().replace("[0.001, 0.002, 0.003]", "[0.001, 0.003]")
                    .replace("  b1: {overrides: [norm=postnorm, optim.lr=1e-3]}",
                             "  b1: {overrides: [norm=postnorm, optim.lr=1e-3], screen: false}"))
    assert "screen: false" in path.read_text() and load_screens(load_study(str(path)), out) == {}
    # a trains claim of an arm that failed at every setting (no seed ever runs) is contradicted
    (out / "screen" / "a.json").write_text(json.dumps(failing))
    v = {x.claim.id: x for x in judge(load_study(str(path)), load_records(out), None, load_screens(load_study(str(path)), out))}
    assert v["t"].verdict == "contradicted" and "every setting of its screen" in v["t"].note


def test_where_fails_names_an_arm_of_a_trains_claim(tmp_path):
    bad = [{**CLAIMS[1], "where_fails": "nope"}]
    with pytest.raises(UserError, match=r"claims\[0\]\.where_fails: 'nope': an arm, on a trains claim"):
        load_study(str(write_study_file(tmp_path, bad)))
    with pytest.raises(UserError, match=r"where_fails"):
        load_study(str(write_study_file(tmp_path / "c", [{**CLAIMS[0], "where_fails": "a"}])))
