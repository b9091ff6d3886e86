"""What an outcome means (issue 35, items 2 and 4): "trains" only within the study's bar of its
reference arm (else "learns, far behind"), a comparison with a run still improving at its cap is
"budget-bound" (from results.json's `plateau` or from metrics.csv), the study keys that set both,
and the README's claims table, which says which interval decides."""
import json

import pytest

from normlab.errors import UserError
from normlab.study.claims import judge
from normlab.study.readme import write_study
from normlab.study.records import load_records
from normlab.study.spec import load_study
from study_files import claim, pairs, record, verdicts, write_study_file

TRAINS = claim(kind="trains", better="b1", than=None)
REF = [("a", s, {"valid_nll": 3.0, "test_bleu": 20.0}) for s in (1, 2)]  # the reference: NLL 3.0, BLEU 20


def b1(nll, bleu, status="completed"):
    return [("b1", s, {"valid_nll": nll, "test_bleu": bleu, "status": status}) for s in (1, 2)]


@pytest.mark.parametrize("nll, bleu, verdict, met", [
    (3.25, 5.0, "held", {"valid_nll": True, "test_bleu": False}),    # within 0.3 nats, BLEU a quarter
    (3.6, 11.0, "held", {"valid_nll": False, "test_bleu": True}),    # 0.6 nats behind, BLEU 0.55 of it
    (3.6, 8.0, "learns, far behind", {"valid_nll": False, "test_bleu": False}),
    (3.31, 9.9, "learns, far behind", {"valid_nll": False, "test_bleu": False}),  # just outside both
])
def test_trains_is_held_only_within_the_bar_of_the_reference(tmp_path, nll, bleu, verdict, met):
    v = verdicts(tmp_path, [TRAINS], REF + b1(nll, bleu), extra="reference: a\n")["c"]
    assert v.verdict == verdict and {k: v.bar[k]["met"] for k in met} == met
    assert v.bar["valid_nll"]["gap"] == pytest.approx(nll - 3.0) and v.bar["test_bleu"]["ratio"] == pytest.approx(bleu / 20)
    # the cell says which criterion was met
    from normlab.study.verdict_text import ours_cell

    cell = ours_cell(v.as_dict())
    assert f"(bar 0.5: {'met' if met['test_bleu'] else 'not met'})" in cell
    assert f"(bar 0.3: {'met' if met['valid_nll'] else 'not met'})" in cell


def test_the_bar_is_the_studys_and_without_a_reference_trains_means_completed(tmp_path):
    far = REF + b1(3.6, 8.0)
    bar = "reference: a\ntrains_bar: {valid_nll: 0.7}\n"  # the ratio keeps its default 0.5
    v = verdicts(tmp_path, [TRAINS], far, extra=bar)["c"]
    assert v.verdict == "held" and v.bar["valid_nll"]["bar"] == 0.7 and v.bar["test_bleu"]["bar"] == 0.5
    assert verdicts(tmp_path / "ratio", [TRAINS], far, extra="reference: a\ntrains_bar: {test_bleu_ratio: 0.4}\n"
                    )["c"].verdict == "held"
    v = verdicts(tmp_path / "none", [TRAINS], far)["c"]  # no reference: how the runs ended, as before
    assert v.verdict == "held" and v.bar is None
    stalled = [("a", s, {"status": "stalled"}) for s in (1, 2)] + b1(3.6, 8.0)
    assert verdicts(tmp_path / "s", [TRAINS], stalled, extra="reference: a\n")["c"].verdict == "no score"
    assert verdicts(tmp_path / "n", [TRAINS], b1(3.6, 8.0), extra="reference: a\n")["c"].verdict == "not run"
    v = verdicts(tmp_path / "f", [TRAINS], REF + b1(None, None, "stalled"), extra="reference: a\n")["c"]
    assert v.verdict == "contradicted"  # every seed stalled: the bar is not reached for


PLATEAU = "plateau: {window: 500, min_delta: 0.01, cap: 2000}\n"
STILL = {"step": None, "window": 500, "min_delta": 0.01, "cap": 2000}


def test_budget_bound_from_the_runs_own_plateau_record(tmp_path):
    """results.json's `plateau` (written by the run): step null = never plateaued, so the comparison
    is budget-bound whatever its interval; a run that plateaued is judged on the interval."""
    rows = pairs([27.0, 27.2, 26.9], [24.0, 24.1, 24.3])
    stopped = {**STILL, "step": 1500}
    done = [(arm, s, {**m, "plateau": stopped}) for arm, s, m in rows]
    assert verdicts(tmp_path / "done", [claim()], done, extra=PLATEAU)["c"].verdict == "held"
    still = [(arm, s, {**m, "plateau": STILL if (arm, s) == ("b1", 2) else stopped}) for arm, s, m in rows]
    v = verdicts(tmp_path / "still", [claim()], still, extra=PLATEAU)["c"]
    assert v.verdict == "budget-bound" and v.improving == {"b1": [2]} and v.interval.low > 0
    assert "still improving when it stopped" in v.note and "b1 s2" in v.note
    assert v.as_dict()["budget_bound"] == {"b1": [2]}
    # without `plateau:` the study judges as before
    assert verdicts(tmp_path / "off", [claim()], still)["c"].verdict == "held"


def curve(path, losses):
    rows = ["epoch,step,valid/loss"] + [f"0,{s},{x}" for s, x in zip((499, 999, 1499, 1999), losses)]
    (path / "metrics.csv").write_text("\n".join(rows) + "\n")


@pytest.mark.parametrize("losses, verdict", [
    ((5.0, 4.0, 3.5, 3.2), "budget-bound"),  # gained 0.3 in the last 500 steps: still improving
    ((5.0, 4.0, 3.995, 3.99), "held"),       # gained 0.005 < 0.01 by step 1499: a plateau
])
def test_budget_bound_from_metrics_csv_for_records_without_one(tmp_path, losses, verdict):
    """A record from before runs stopped at a plateau: normlab.plateau's rule on its valid/loss."""
    study = load_study(str(write_study_file(tmp_path, [claim()], extra=PLATEAU)))
    out = tmp_path / "out"
    for arm, seed, metrics in pairs([27.0, 27.2, 26.9], [24.0, 24.1, 24.3]):
        record(out, arm, seed, steps=2000, **metrics)
        curve(out / "runs" / f"{arm}-s{seed}", losses if arm == "a" else (5.0, 4.0, 3.995, 3.99))
    (v,) = judge(study, load_records(out), None)
    assert v.verdict == verdict and v.improving == ({"a": [1, 2, 3]} if verdict == "budget-bound" else {})


def test_a_stalled_run_is_not_still_improving_and_an_unknown_plateau_is_said(tmp_path):
    from normlab.study.records import Record

    assert Record(tmp_path, "a", 1, {"status": "stalled", "plateau": STILL}).still_improving(500, 0.01, 2000) is False
    assert Record(tmp_path, "a", 1, {"status": "completed"}).still_improving(500, 0.01, 2000) is None
    v = verdicts(tmp_path, [claim()], pairs([27.0, 27.2, 26.9], [24.0, 24.1, 24.3]), extra=PLATEAU)["c"]
    assert v.verdict == "held" and "plateau not known (no valid/loss curve): a s1" in v.note


def test_trains_notes_a_run_still_improving(tmp_path):
    rows = REF + [(arm, s, {**m, "plateau": STILL}) for arm, s, m in b1(3.1, 19.0)]
    v = verdicts(tmp_path, [TRAINS], rows, extra="reference: a\n" + PLATEAU)["c"]
    assert v.verdict == "held" and "b1 s1, s2" in v.note


@pytest.mark.parametrize("extra, where", [
    ("reference: zz\n", "reference: 'zz' is not an arm (allowed: a, b1, b2)"),
    ("trains_bar: {valid_nll: 0.3}\n", "reference: missing: trains_bar measures"),
    ("reference: a\ntrains_bar: {valid_nl: 0.3}\n", "trains_bar.valid_nl: not a key here (allowed: valid_nll, "
                                                    "test_bleu_ratio)"),
    ("reference: a\ntrains_bar: {test_bleu_ratio: 1.5}\n", "trains_bar.test_bleu_ratio: 1.5: must be a number in [0, 1]"),
    ("plateau: {window: 500, cap: 2000}\n", "plateau.min_delta: missing"),
    ("plateau: {window: 0.5, min_delta: 0.01, cap: 2000}\n", "plateau.window: 0.5: must be an integer >= 1"),
    ("plateau: 500\n", "plateau: must be a mapping of window, min_delta, cap"),
])
def test_bad_judging_keys_are_one_error(tmp_path, extra, where):
    with pytest.raises(UserError, match=f"^s.yaml: {where}".replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        load_study(str(write_study_file(tmp_path, [claim()], extra=extra)))
    path = write_study_file(tmp_path, [claim()], families={"a": "F"})
    path.write_text(path.read_text().replace("family: F", "family: [F]"))
    with pytest.raises(UserError, match=r"arms.a.family: must be a name"):
        load_study(str(path))


def test_the_readme_says_which_interval_decides(tmp_path):
    """The claims table: the seed interval (decides) beside the test-set check (does not), the text
    under it, and claims.json's fields for both."""
    study = load_study(str(write_study_file(tmp_path, [claim(paper_effect="+0.83 BLEU")], families={"a": "F"})))
    out = tmp_path / "out"
    for arm, seed, metrics in pairs([27.0, 27.2, 26.9], [24.0, 24.1, 24.3]):
        record(out, arm, seed, **metrics)
    by_arm = load_records(out)
    write_study(study, by_arm, judge(study, by_arm, None), out, "normlab-study s")
    text = (out / "README.md").read_text()
    assert ("| claim | source | paper | ours: A − B, 95% seed interval (decides) | test-set check (per-run, "
            "sentences; does not decide) | verdict |") in text
    assert "The verdict comes from the seed-level interval" in text and "never decides" in text
    assert "| paper | +1 (effect: +0.83 BLEU) | +2.90 [" in text and "(t over 3 paired seeds, df " in text
    (c,) = json.loads((out / "claims.json").read_text())["claims"]
    assert c["difference"]["decides"] and c["difference"]["df"] > 0 and c["test_set_check"] is None
    assert c["variance"]["a"]["source"] == "family:F" and c["paper_effect"] == "+0.83 BLEU"
