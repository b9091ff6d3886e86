"""A run validates at its last step too when max_steps is not a multiple of the validation interval
(callbacks/validate_at_end.py): 6 steps with validation every 4 validate at 4 and 6, 3 steps at 3
(it used to validate never), 8 steps at 4 and 8 only (unchanged)."""
import csv

import pytest

from normlab.train import run

from conftest import compose_cfg, tiny_overrides

pytestmark = pytest.mark.integration  # every test trains or runs a command through the entry point


@pytest.mark.parametrize("steps, validated", [(6, [4, 6]), (3, [3]), (8, [4, 8])])
def test_validation_at_the_last_step(steps, validated, small_corpus, tmp_path):
    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache")
                      + [f"trainer.max_steps={steps}", "trainer.val_check_interval=4", "eval.test=false"])
    results = run(cfg)
    assert results["status"] == "completed" and results["steps"] == steps
    rows = list(csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")))
    # Lightning's CSV step of a validation after n optimizer steps is n - 1
    assert [int(r["step"]) + 1 for r in rows if r.get("valid/loss")] == validated
    best = sorted((tmp_path / "run" / "checkpoints").glob("best-step*.ckpt"))
    assert best and all(int(p.stem.split("step")[1]) in validated for p in best)  # chosen among the validated
    train_steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert len(train_steps) == len(set(train_steps))  # the stop adds no second row for a step
