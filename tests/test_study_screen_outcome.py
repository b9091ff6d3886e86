"""Outcome claims judged on the learning-rate screens (study/screen_outcome.py, issue 35 item 4):
"fails" holds when an arm failed at every setting of its screen; "X trains where post-LN fails" needs
X to train at the settings where post-LN diverged or stalled."""
import json

import pytest

from normlab.errors import UserError
from normlab.study.claims import judge
from normlab.study.records import load_records
from normlab.study.screen_outcome import failed_settings, fails_on_screen, load_screens, where_fails
from normlab.study.spec import load_study

from study_files import record, write_study_file

GRID = ["lr0.001-warmup150", "lr0.003-warmup150", "lr0.003-warmup1000"]


def screen(values: dict, statuses: dict | None = None, chosen="auto") -> dict:
    """A screen record as screen_run writes it: {setting: value at the first rung (None: no value)}."""
    statuses = statuses or {}
    rows = [{"name": n, "overrides": [], "values": {"500": v}, "status": statuses.get(n, "stopped" if v else "stalled"),
             "dropped_at": 500} for n, v in values.items()]
    scored = {n: v for n, v in values.items() if v is not None}
    pick = (min(scored, key=scored.get) if scored else None) if chosen == "auto" else chosen
    return {"arm": "x", "by": "valid_loss", "rungs": [500, 1000], "keep": 0.25, "seed": 1, "settings": rows, "chosen": pick}


def test_a_setting_fails_when_it_diverged_stalled_or_has_no_value_at_the_first_rung():
    s = screen({GRID[0]: 5.1, GRID[1]: None, GRID[2]: 4.8}, {GRID[2]: "diverged"})
    assert failed_settings(s) == [GRID[1], GRID[2]]  # a diverged run's logged value does not count
    assert fails_on_screen(s) == (False, f"its screen: diverged or stalled at 2 of 3 settings, trained at {GRID[0]}")
    assert fails_on_screen(screen(dict.fromkeys(GRID))) == (True, "diverged or stalled at every setting of its screen (3 of 3)")
    assert fails_on_screen(None) == (False, "")


def test_trains_where_the_other_fails_is_judged_on_the_settings_where_it_failed():
    post = screen({GRID[0]: 6.0, GRID[1]: None, GRID[2]: None})  # post-LN trains only at the lowest lr
    assert where_fails("admin", screen({GRID[0]: 5.0, GRID[1]: 4.5, GRID[2]: 4.4}), "post_ln", post) == (
        "held", f"where post_ln diverged or stalled ({GRID[1]}, {GRID[2]}), admin trained at 2 of 2")
    part, line = where_fails("admin", screen({GRID[0]: 5.0, GRID[1]: 4.5, GRID[2]: None}), "post_ln", post)
    assert part == "inconclusive" and line.endswith(f"admin trained at 1 of 2 ({GRID[1]})")
    assert where_fails("admin", screen({GRID[0]: 5.0, GRID[1]: None, GRID[2]: None}), "post_ln", post)[0] == "contradicted"
    everywhere = screen({GRID[0]: 6.0, GRID[1]: 5.9, GRID[2]: 5.8})
    assert where_fails("admin", everywhere, "post_ln", everywhere) == (
        None, "post_ln trained at every setting of its screen: 'where post_ln fails' is untested here")
    assert where_fails("admin", None, "post_ln", post)[0] is None


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


def test_where_fails_names_an_arm_of_a_trains_claim(tmp_path):
    bad = [{**CLAIMS[1], "where_fails": "nope"}]
    with pytest.raises(UserError, match=r"claims\[0\]\.where_fails: 'nope': an arm, on a trains claim"):
        load_study(str(write_study_file(tmp_path, bad)))
    with pytest.raises(UserError, match=r"where_fails"):
        load_study(str(write_study_file(tmp_path / "c", [{**CLAIMS[0], "where_fails": "a"}])))
