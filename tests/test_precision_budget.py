"""Mixed precision and accumulation that do not misfire: bf16 and fp16 runs train on CPU, fp16
loss-scaler overflows are not divergence (a persistent non-finite loss is), validation counts
optimizer steps, and the `_paper` presets reach their tokens per update through devices x
accumulation."""
import csv

import pytest
import torch

import normlab.train
from normlab.budget import trainer_overrides
from normlab.checkpoint_io import AtomicCheckpointIO
from normlab.lit_module import Seq2SeqModule
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

QUICK = ["eval.test=false", "eval.valid_bleu=false", "trainer.log_every_n_steps=1", "callbacks.step_checkpoints.keep_last_n=0"]


def quick(small_corpus, tmp_path, *more):
    return compose_cfg(tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + QUICK + list(more))


def rows(tmp_path, key):
    return [(int(r["step"]), float(r[key])) for r in csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv"))
            if r.get(key)]


@pytest.mark.integration
def test_bf16_mixed_runs_on_cpu(small_corpus, tmp_path):
    results = run(quick(small_corpus, tmp_path, "trainer.precision=bf16-mixed", "trainer.max_steps=3"))
    assert results["status"] == "completed" and results["steps"] == 3


@pytest.fixture()
def fp16(monkeypatch):
    """16-mixed with a loss scaler on CPU (Lightning would switch a plain `16-mixed` to bf16 on CPU);
    an initial scale of 2^40 makes the first steps overflow, as fp16 runs do at their start."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugins():
        return [AtomicCheckpointIO(), MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0 ** 40))]
    monkeypatch.setattr(normlab.train, "_plugins", plugins)
    return ["trainer.precision=null"]


@pytest.mark.integration
def test_fp16_overflow_steps_are_skipped_not_divergence(small_corpus, tmp_path, fp16):
    results = run(quick(small_corpus, tmp_path, *fp16, "trainer.max_steps=14"))
    assert results["status"] == "completed" and results["steps"] == 14
    overflows = rows(tmp_path, "train/overflow_steps")
    assert overflows[-1][1] >= 5  # 2^40 halves to a finite scale in a dozen steps or so: each a skipped step


@pytest.mark.integration
def test_fp16_persistent_non_finite_loss_is_divergence(small_corpus, tmp_path, fp16, monkeypatch):
    original = Seq2SeqModule.training_step

    def step(self, batch, batch_idx):
        loss = original(self, batch, batch_idx)
        return loss * float("nan") if self.global_step >= 2 else loss
    monkeypatch.setattr(Seq2SeqModule, "training_step", step)
    results = run(quick(small_corpus, tmp_path, *fp16, "trainer.max_steps=20", "callbacks.divergence.patience=3"))
    assert results["status"] == "diverged" and results["diverged_step"] == 4  # NaN at 2, 3, 4
    assert "for 3 steps" in results["divergence_reason"]


@pytest.mark.integration
def test_validation_interval_counts_optimizer_steps_under_accumulation(small_corpus, tmp_path):
    run(quick(small_corpus, tmp_path, "trainer.accumulate_grad_batches=2", "trainer.max_steps=6",
              "trainer.val_check_interval=3"))
    # validation after optimizer steps 3 and 6 (logged at step 2 and 5), not every 3 batches (1, 2, 4, 5);
    # the final scoring's re-validation logs nothing (one score per key)
    assert [s for s, _ in rows(tmp_path, "valid/loss")] == [2, 5]


@pytest.mark.parametrize("devices, nodes, accumulate", [(1, 1, 8), (2, 1, 4), (4, 1, 2), (4, 2, 1)])
def test_paper_presets_reach_their_tokens_per_update(devices, nodes, accumulate):
    cfg = compose_cfg(["experiment=layerdrop_paper", f"trainer.devices={devices}", f"trainer.num_nodes={nodes}"])
    out = trainer_overrides(cfg.trainer, cfg.data.max_tokens, cfg.optim.tokens_per_update)
    assert out["accumulate_grad_batches"] == accumulate
    assert cfg.data.max_tokens * devices * nodes * accumulate == cfg.optim.tokens_per_update
    assert out["val_check_interval"] == cfg.trainer.val_check_interval * accumulate
