"""The real training loop under DDP: 2 CPU processes (gloo), Lightning's ddp strategy, train.py. (A plain
2-process run, under Lightning's launcher, torchrun and submitit: tests/test_engines.py.)"""
import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import ROOT
from normlab.data.datamodule import TranslationDataModule
from normlab.data.tokenizer import Tokenizer
from test_final_test import check_independent

pytestmark = pytest.mark.integration  # every test trains or runs a command through the entry point


def ddp_run(small_corpus, tmp_path, *extra):
    run_dir = tmp_path / "run"
    overrides = [f"data.{k}={v}" for k, v in small_corpus.items()] + [
        "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
        "data.vocab_size=300", "data.max_tokens=512", f"data.cache_dir={tmp_path / 'cache'}",
        "model.d_model=32", "model.encoder_ffn=64", "model.decoder_ffn=64", "model.encoder_layers=1",
        "model.decoder_layers=1", "regularizer=layerdrop_drophead", "trainer.max_steps=6",
        "trainer.val_check_interval=3", "trainer.enable_progress_bar=false", "logger=csv",
        "eval.decoder.max_len_b=5", "eval.test_decoder.max_len_b=5", f"hydra.run.dir={run_dir}", *extra,
    ]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and results["steps"] == 6
    assert results["choices"]["trainer"] == "ddp"
    return results


def eval_batches(run_dir, cfg) -> dict[str, int]:
    """The number of evaluation batches of valid and test in one process (before sharding), from a
    data module of the run's data config and tokenizer."""
    data = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "_target_"}
    dm = TranslationDataModule(**data, tokenizer=Tokenizer.load(run_dir / "tokenizer"))
    dm.setup("test")
    return {split: dm.dataloader(split).batch_sampler.num_batches for split in ("valid", "test")}


def test_two_process_ddp_with_the_attention_options_and_layer_one_dropped(small_corpus, tmp_path):
    # Issue 20: with LayerDrop dropping layer 1, the value residual's λ of the first layer that runs
    # are not used; they must still get a (zero) gradient, or DDP without find_unused_parameters
    # stops at the next step. Derf and QK-norm parameters are used at every step.
    ddp_run(small_corpus, tmp_path, "model.encoder_layers=3", "model.decoder_layers=3", "model.value_residual=true",
            "model.qk_norm=l2", "norm=derf", "regularizer.encoder_layerdrop=0.5", "regularizer.decoder_layerdrop=0.5",
            "eval.test=false")


def test_two_process_final_scores_equal_one_process_scoring_the_checkpoints(small_corpus, tmp_path):
    """The final passes under DDP: each rank scores its shard of the split (the loader the data module
    builds for it), the ranks' loss sums and hypotheses are combined, and the scores equal what one
    process computes from the checkpoint files over the whole split. 7 eval batches (eval_max_tokens
    512): the shards are padded with a repeated batch, which must count once. (No LayerDrop: the
    averaged pass with LayerDrop, which takes the last checkpoint's draw counter, is tested in one
    process in tests/test_commands.py.)"""
    results = ddp_run(small_corpus, tmp_path, "data.eval_max_tokens=512", "callbacks.step_checkpoints.every_n_steps=3",
                      "callbacks.step_checkpoints.keep_last_n=2", "regularizer.encoder_layerdrop=0",
                      "regularizer.decoder_layerdrop=0")
    run_dir = tmp_path / "run"
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    # An odd count on both splits, so one of the 2 ranks gets a repeated batch and the de-duplication
    # is exercised (a change to the corpus, tokenizer or eval_max_tokens could make it even).
    counts = eval_batches(run_dir, cfg)
    assert all(n % 2 == 1 for n in counts.values()), counts
    check_independent(run_dir, results, cfg, rel=1e-12)


@pytest.mark.slow  # make test: the subset in one process (test_valid_subset.py) and the ranks' shards combined (the final-scores test above)
def test_two_process_validation_bleu_on_a_subset(small_corpus, tmp_path):
    """eval.valid_subset under DDP: the subset's batches are sharded over the ranks as the whole set's
    are (an odd count: a repeated batch must count once), and each validation logs the subset's BLEU
    and the whole set's loss of that step's weights, as one process computes them from the step
    checkpoints."""
    import csv

    import torch

    from normlab.checkpoint import load_model
    from normlab.evaluation import make_decoder, score, subset_rows, translate_batches
    from normlab.losses import model_loss

    ddp_run(small_corpus, tmp_path, f"eval.valid_subset={SUBSET}", "data.eval_max_tokens=512", "eval.test=false",
            "callbacks.step_checkpoints.every_n_steps=3", "callbacks.step_checkpoints.keep_last_n=2",
            "regularizer.encoder_layerdrop=0", "regularizer.decoder_layerdrop=0")
    run_dir = tmp_path / "run"
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    data = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "_target_"}
    tok = Tokenizer.load(run_dir / "tokenizer")
    dm = TranslationDataModule(**data, tokenizer=tok)
    dm.setup("test")
    rows = subset_rows(len(dm.references("valid")), SUBSET)
    assert dm.dataloader("valid", rows=rows).batch_sampler.num_batches % 2 == 1  # a change to the corpus or
    assert dm.dataloader("valid").batch_sampler.num_batches % 2 == 1  # tokenizer could make them even
    logged = {}
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("valid/bleu"):
                logged[int(row["step"]) + 1] = (float(row["valid/bleu"]), float(row["valid/loss"]))
    assert sorted(logged) == [3, 6]
    for step, (bleu, loss) in logged.items():
        model, _ = load_model(run_dir / "checkpoints" / f"step{step}.ckpt")
        hyps = translate_batches(model, dm.dataloader("valid", rows=rows), make_decoder(**cfg.eval.decoder), tok.decode)
        refs = dm.references("valid")
        assert sorted(hyps) == list(rows)
        assert bleu == pytest.approx(score([hyps[i] for i in rows], [refs[i] for i in rows])["bleu"], abs=1e-4)
        total = ntok = 0.0
        with torch.no_grad():
            for b in dm.dataloader("valid"):
                lo, _, _ = model_loss(model, b["src"], b["tgt_in"], b["tgt_out"], cfg.optim.label_smoothing,
                                   model.cfg.pad_id, cfg.optim.get("label_smoothing_convention", "uniform"))
                total, ntok = total + lo.item(), ntok + int(b["tgt_out"].ne(model.cfg.pad_id).sum())
        assert loss == pytest.approx(total / ntok, rel=1e-6)  # float32 in the CSV


SUBSET = 15  # of the 40 valid sentences: 3 batches at eval_max_tokens 512 (odd: a rank repeats one; the loss: 7)
