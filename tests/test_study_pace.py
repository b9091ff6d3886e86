"""Pace (normlab/study/pace.py): where each arm ended, read on the best arm's validation curve."""
import pytest

from normlab.study.pace import pace_lines, reached_at
from normlab.study.records import load_records
from normlab.study.spec import load_study

from study_files import record, write_study_file


def test_reached_at_interpolates_between_validations():
    curve = [(499, 5.0), (999, 4.0), (1499, 3.0)]
    assert reached_at(curve, 4.0) == 999  # on a point
    assert reached_at(curve, 3.5) == pytest.approx(1249)  # halfway between 999 and 1499
    assert reached_at(curve, 6.0) == 499  # already below at its first validation
    assert reached_at(curve, 2.0) is None  # never got there
    assert reached_at([(0, 1.0), (10, 3.0)], 2.0, lower=False) == pytest.approx(5)  # higher is better


def _curve(out, arm, seed, losses, status="completed"):
    record(out, arm, seed, status=status)
    rows = ["epoch,step,valid/loss"] + [f"0,{500 * (i + 1) - 1},{v}" for i, v in enumerate(losses)]
    (out / "runs" / f"{arm}-s{seed}" / "metrics.csv").write_text("\n".join(rows) + "\n")


def test_pace_reads_each_arm_on_the_best_arms_mean_curve(tmp_path):
    study = load_study(str(write_study_file(tmp_path, [])))
    out = tmp_path / "out"
    _curve(out, "a", 1, [5.0, 4.0, 3.0, 2.0])  # the best: a mean curve of 5, 4, 3, 2 over two seeds
    _curve(out, "a", 2, [5.0, 4.0, 3.0, 2.0])
    _curve(out, "b1", 1, [5.5, 4.8, 4.2, 3.6])  # ends at 3.5 (mean of 3.6 and 3.4): a's step 1249 -> 1250
    _curve(out, "b1", 2, [5.5, 4.8, 4.2, 3.4])
    _curve(out, "b2", 1, [9.0, 1.0, 0.5, 0.1], status="diverged")  # not completed: no row
    lines = pace_lines(study, load_records(out))
    table = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ") and "---" not in line}
    assert "(the reference)" in table["a"]
    assert "| 3.500 | ~1250 (62% of its 2000 steps) |" in table["b1"]
    assert "b2" not in table


def test_no_pace_with_fewer_than_two_arms_that_have_curves(tmp_path):
    study = load_study(str(write_study_file(tmp_path, [])))
    out = tmp_path / "out"
    _curve(out, "a", 1, [5.0, 4.0])
    record(out, "b1", 1)  # no metrics.csv
    assert pace_lines(study, load_records(out)) == []


def test_a_trains_claim_shows_how_far_its_arm_got(tmp_path):
    """"Trains" means no divergence and no stall; a run can complete far below its peers (DeepNorm at
    12+12: test BLEU 1.36 where pre-LN reached 14.64), so the cell shows its mean beside its status,
    in the study's README and in the index of every claim."""
    import json

    from normlab.study.index import update_index
    from normlab.study.verdict_text import outcome_text

    assert outcome_text({"completed": 2}, 1.364, "test_bleu") == "completed 2 (test_bleu 1.36)"
    assert outcome_text({"stalled": 1}, None, "test_bleu") == "stalled 1"
    (tmp_path / "s").mkdir()
    claim = {"id": "c", "claim": "X trains", "source": "s", "paper": "p", "kind": "trains", "metric": "test_bleu",
             "verdict": "held", "better": "x", "than": None, "means": {"x": 1.36}, "statuses": {"x": {"completed": 1}},
             "difference": None}
    (tmp_path / "s" / "claims.json").write_text(json.dumps({"study": "s", "budget": "full", "claims": [claim]}))
    update_index(tmp_path / "README.md")
    assert "| x: completed 1 (test_bleu 1.36) | how the runs ended | **held** |" in (tmp_path / "README.md").read_text()


def test_a_study_part_way_says_how_many_runs_it_has():
    from types import SimpleNamespace

    from normlab.study.readme import _unfinished

    study = SimpleNamespace(arms={"a": 1, "b": 2}, seeds=[1, 2], kind="train", planned=4)  # Study.planned: test_study_seeds
    assert _unfinished(study, {"runs": 3}) == "; 3 of 4 planned runs recorded, the same command continues"
    assert _unfinished(study, {"runs": 4}) == ""
