"""resume= under another trainer.max_steps than the checkpoint trained with: a decaying schedule's
total changes, and with it the learning rate at once; extending a run is legitimate, so the run says so
in one warning line with both learning rates, and trains."""
import csv
import logging

import pytest

from normlab.lr_schedule import lr_factor
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

pytestmark = pytest.mark.integration  # every test trains or runs a command through the entry point


def lrs(run_dir) -> dict[int, float]:
    rows = [r for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("train/lr")]
    return {int(r["step"]): float(r["train/lr"]) for r in rows}


def test_resume_with_another_total_says_how_the_lr_jumps(small_corpus, tmp_path, caplog):
    def tiny(name, *extra):
        return tiny_overrides(small_corpus, tmp_path / name, tmp_path / "cache") + [
            "optim.schedule=cosine", "optim.lr=2e-3", "optim.warmup=2", "eval.valid_bleu=false", "eval.test=false",
            "trainer.log_every_n_steps=1", "callbacks.step_checkpoints.keep_last_n=0", *extra]

    # leg 1: 4 updates of a cosine to 0 by step 8 (one epoch of 4 batches), then stop
    run(compose_cfg(tiny("first", "trainer.max_steps=8", "trainer.max_epochs=1", "+trainer.limit_train_batches=4")))
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    with caplog.at_level(logging.WARNING, logger="normlab"):
        run(compose_cfg(tiny("same", "trainer.max_steps=8", f"resume={ckpt}")))
    assert not [r for r in caplog.records if "trainer.max_steps" in r.getMessage()]  # the same total: silent
    same = lrs(tmp_path / "same")  # and the lr of a run trained straight through
    assert same and all(same[s] == pytest.approx(2e-3 * lr_factor("cosine", s + 1, 2, 8), rel=1e-6) for s in same)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="normlab"):
        run(compose_cfg(tiny("longer", "trainer.max_steps=12", f"resume={ckpt}")))
    # update 5: 2e-3 * (1 + cos(pi * 2/6)) / 2 = 1.5e-3 of the cosine to 8, 2e-3 * (1 + cos(pi * 2/10)) / 2 of the one to 12
    (line,) = [r.getMessage() for r in caplog.records if "trainer.max_steps" in r.getMessage()]
    assert line == f"resume={ckpt}: trainer.max_steps 8 -> 12: the learning rate of update 5 jumps from 0.0015 to 0.001809"
    lr = lrs(tmp_path / "longer")  # by 0-based step: update 5 is step 4
    assert lr[4] == pytest.approx(1.809017e-3, rel=1e-6)  # the run's schedule from the first resumed update
    assert lr[5] == pytest.approx(2e-3 * lr_factor("cosine", 6, 2, 12), rel=1e-6)
