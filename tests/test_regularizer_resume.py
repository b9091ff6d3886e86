"""Resuming a run with LayerDrop + scheduled DropHead continues both where they stopped: the
DropHead rate follows the schedule of the global step, the LayerDrop draw counter continues."""
import csv

import pytest
import torch

from normlab.checkpoint import load_checkpoint
from normlab.regularizers.rate_schedules import schedule_value
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

pytestmark = pytest.mark.integration  # every test trains or runs a command through the entry point


def test_resume_continues_drophead_schedule_and_layerdrop_draws(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    base = tiny_overrides(small_corpus, run_dir, tmp_path / "cache") + [
        "regularizer=layerdrop_drophead", "eval.test=false", "eval.valid_bleu=false", "trainer.log_every_n_steps=1",
        "callbacks.step_checkpoints.keep_last_n=0", "+trainer.limit_train_batches=4"]
    # leg 1: one epoch of 4 batches (of max_steps = 8), then stop
    run(compose_cfg(base + ["trainer.max_epochs=1"]))
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    first = load_checkpoint(ckpt)
    assert first["global_step"] == 4
    assert first["state_dict"]["model.encoder.layers.draw_state"][1] == 4  # one draw per training forward
    # leg 2: another budget is another run (its own folder), started from leg 1's state
    run2 = tmp_path / "run2"
    results = run(compose_cfg(base + ["trainer.max_epochs=-1", f"resume={ckpt}", f"++run_dir={run2}"]))
    assert results["steps"] == 8
    final = load_checkpoint(run2 / "checkpoints" / "last.ckpt")
    assert final["state_dict"]["model.encoder.layers.draw_state"][1] == 8
    assert torch.equal(final["state_dict"]["model.decoder.layers.draw_state"][0],
                       first["state_dict"]["model.decoder.layers.draw_state"][0])  # same seed
    rows = [r for r in csv.DictReader(open(run2 / "csv" / "metrics.csv")) if r.get("regularizer/drophead_p")]
    logged = {int(r["step"]): float(r["regularizer/drophead_p"]) for r in rows}
    assert {4, 5, 6, 7} <= set(logged)  # the resumed leg's batches
    for step, p in logged.items():  # V shape, p = 0.2, warmup = optim.warmup = 4, last step 8
        assert p == pytest.approx(schedule_value("v_shape", step + 1, 0.2, total=8, warmup=4))
