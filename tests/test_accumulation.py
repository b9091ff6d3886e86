"""Gradient accumulation is the same update as DDP and as one process on the union batch (fairseq):
the loss of an update is normalised by the non-pad target tokens of the whole update. And the
guards count optimizer steps, not micro-batches (stall and divergence fire under accumulation)."""
import lightning as L
import numpy as np
import pytest
import torch

from normlab.callbacks.divergence import DivergenceGuard
from normlab.config import ModelConfig
from normlab.data.batching import collate
from normlab.lit_module import Seq2SeqModule
from normlab.settings import EvalSpec, OptimSpec
from normlab.train import run

from conftest import FakeModule, FakeTrainer, compose_cfg, tiny_overrides

PAD, BOS, EOS, V = 0, 1, 2, 40
MODEL = {"vocab_size": V, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_heads": 2,
         "decoder_heads": 2, "encoder_ffn": 32, "decoder_ffn": 32, "pad_id": PAD, "bos_id": BOS, "eos_id": EOS}
OPTIM = OptimSpec(lr=1e-3, warmup=1, betas=[0.9, 0.98], eps=1e-9, label_smoothing=0.1)


def batch(seed: int, rows: int) -> dict:
    """A right-padded batch of random pairs with lengths that differ (so token counts differ)."""
    rng = np.random.default_rng(seed)
    src_len, tgt_len = rng.integers(2, 9, rows), rng.integers(1, 12, rows)
    src = np.zeros((rows, src_len.max()), dtype=np.int64)
    tgt = np.zeros((rows, tgt_len.max()), dtype=np.int64)
    for i in range(rows):
        src[i, :src_len[i]] = rng.integers(3, V, src_len[i])
        tgt[i, :tgt_len[i]] = rng.integers(3, V, tgt_len[i])
    return collate(np.arange(rows), src, src_len, tgt, tgt_len, PAD, BOS, EOS)


class Recorder(Seq2SeqModule):
    """Records the gradients the optimizer step will use (after the update's normalisation)."""

    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.grads = {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}


def lightning_grads(batches: list[dict], accumulate: int, model: dict | None = None) -> dict:
    torch.manual_seed(0)
    module = Recorder(model or MODEL, optim=OPTIM, eval=EvalSpec())
    trainer = L.Trainer(accelerator="cpu", max_steps=1, accumulate_grad_batches=accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return module.grads


def union(a: dict, b: dict) -> dict:
    """One batch holding both (padded to the longer rows)."""
    out = {}
    for k in ("src", "tgt_in", "tgt_out"):
        width = max(a[k].shape[1], b[k].shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=PAD)  # noqa: E731
        out[k] = torch.cat([pad(a[k]), pad(b[k])])
    out["idx"] = torch.arange(len(out["src"]))
    out["ntokens"] = a["ntokens"] + b["ntokens"]
    return out


def test_accumulating_two_micro_batches_is_one_update_on_their_union():
    b1, b2 = batch(1, 3), batch(2, 5)
    assert b1["ntokens"] != b2["ntokens"]  # equal counts would hide a per-micro-batch normalisation
    accumulated = lightning_grads([b1, b2], accumulate=2)
    whole = lightning_grads([union(b1, b2)], accumulate=1)
    assert accumulated.keys() == whole.keys() and accumulated
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)
    # the old normalisation (mean of per-micro-batch means) is measurably different here
    torch.manual_seed(0)
    ref = Seq2SeqModule(MODEL, optim=OPTIM, eval=EvalSpec())
    per_batch = [ref._loss(b) for b in (b1, b2)]
    (sum(loss / n for loss, _, n, _ in per_batch) / 2).backward()
    differs = [n for n, p in ref.named_parameters() if p.grad is not None
               and not torch.allclose(p.grad, whole[n], rtol=1e-3, atol=1e-6)]
    assert differs


def test_divergence_patience_counts_optimizer_steps():
    guard, trainer, module = DivergenceGuard(factor=2.0, patience=3), FakeTrainer(), FakeModule()
    for update, loss in enumerate([1.0, 5.0, 5.0, 5.0]):
        for micro in range(4):  # accumulate 4: the optimizer step ends with the 4th micro-batch
            guard.on_train_batch_start(trainer, module, None, 0)
            if micro == 3:
                trainer.global_step += 1
            guard.on_train_batch_end(trainer, module, {"loss": torch.tensor(loss / 4), "token_loss": torch.tensor(loss)},
                                     None, 0)
            if update < 3:
                assert guard.outcome.running, (update, micro)  # 3 high micro-batches are not 3 steps
    assert guard.outcome.status == "diverged" and guard.min_loss == 1.0  # the per-token loss, not Lightning's 1/4


@pytest.mark.integration
def test_stall_stops_early_under_accumulation(small_corpus, tmp_path):
    """The same stalled run as tests/test_stall.py with accumulate 4: found at optimizer step 12 and
    stopped at 20, so its windows count optimizer steps."""
    over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + [
        "callbacks.stall.window=4", "callbacks.stall.patience=8", "callbacks.stall.after_step=0",
        "trainer.max_steps=60", "eval.valid_bleu=false", "eval.test=false", "callbacks.stall.stop_after=8",
        "callbacks.stall.margin=-0.5", "optim.lr=1e-12", "optim.warmup=1", "trainer.accumulate_grad_batches=4",
        "trainer.val_check_interval=1000"]
    res = run(compose_cfg(over))
    assert res["status"] == "stalled" and res["stall_detected_step"] == 12 and res["stopped_at_step"] == 20
    assert res["steps"] == 20


DDP_SCRIPT = """
import json, sys, torch, lightning as L
sys.path.insert(0, {tests!r})
import test_accumulation as t
rank = int(__import__("os").environ["RANK"])
for k in (1, 2):  # per rank: 1 micro-batch, then 2 accumulated
    torch.manual_seed(0)
    module = t.Recorder(json.loads({model!r}), optim=t.OPTIM, eval=t.EvalSpec())
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                        accumulate_grad_batches=k)
    mine = [t.batch(1 + rank * k + i, 3 + 2 * (rank * k + i)) for i in range(k)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(mine, batch_size=None))
    torch.save(module.grads, {out!r} + f"/grads{{rank}}-k{{k}}.pt")
"""


# Issue 20: every scheme is the same update under DDP. Each case is a model of 2+2 layers (Mix-LN
# needs both kinds of layer) with schemes that can be combined; every new placement, norm type,
# attention option, aggregation and residual kind appears in one of them.
SCHEMES = {
    "post (default)": {},
    "b2t, rms QK-norm, value residual": {"norm": {"placement": "b2t"}, "qk_norm": "rms", "value_residual": True},
    "mix, DWA": {"norm": {"placement": "mix", "mix_ratio": 0.5}, "layer_aggregation": "dwa"},
    "pre_scaled, derf": {"norm": {"placement": "pre_scaled", "type": "derf"}},
    "hybrid": {"norm": {"placement": "hybrid"}},
    "hybrid_star": {"norm": {"placement": "hybrid_star"}},
    "reordered": {"norm": {"placement": "reordered"}},
    "hyper dynamic, l2 QK-norm": {"norm": {"placement": "pre"}, "residual": "hyper", "residual_mixing": "dynamic",
                                  "qk_norm": "l2"},
    "mhc dynamic": {"norm": {"placement": "pre"}, "residual": "mhc", "residual_mixing": "dynamic"},
}


# hyper.*: a stream-mixing parameter of hyper-connections (static α, β, the dynamic scale and
# norm, mHC's b_pre and b_res) may get a gradient below 1e-6 of the largest at init, where the n
# streams are equal copies (they part in training: tests/test_hyper.py); k_norm.bias: HybridNorm's
# key norm's bias, a shift shared by every key.
ZERO_AT_INIT = ("hyper.", "layers.0.self_attn.sublayer.value_residual.lambdas", "k_proj.bias", "k_norm.bias")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_two_gloo_processes_equal_accumulation_and_the_union(tmp_path, scheme):
    """2 processes x k micro-batches == 1 process x accumulate 2k == the union batch (gradients), k = 1, 2."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    model = dict(MODEL, **SCHEMES[scheme], **({"encoder_layers": 2, "decoder_layers": 2} if SCHEMES[scheme] else {}))
    ModelConfig(**model)  # every key is a model setting (from_dict would drop a misspelt one)
    script = tmp_path / "ddp_grads.py"
    script.write_text(DDP_SCRIPT.format(tests=str(ROOT / "tests"), out=str(tmp_path), model=json.dumps(model)))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k in (1, 2):  # rank r's micro-batch i is batch(1 + r*k + i, ...): 2*k batches in all
        parts = [batch(1 + j, 3 + 2 * j) for j in range(2 * k)]
        ddp = [torch.load(tmp_path / f"grads{r}-k{k}.pt") for r in (0, 1)]
        whole = parts[0]
        for p in parts[1:]:
            whole = union(whole, p)
        whole = lightning_grads([whole], accumulate=1, model=model)
        accumulated = lightning_grads(parts, accumulate=2 * k, model=model)
        # The compared gradients are there and not zero, except those that are zero at init
        # (ZERO_AT_INIT): hyper-connections' mixing while the streams are equal, the first layer's
        # value-residual λ (V₁ = V_n there), and key biases (softmax ignores a shift shared by every key).
        assert len(whole) == len(ddp[0])
        top = max(float(g.norm()) for g in whole.values())
        zero = sorted(n for n, g in whole.items() if float(g.norm()) <= 1e-6 * top)
        assert all(any(p in n for p in ZERO_AT_INIT) for n in zero), f"k={k}: zero gradients {zero}"
        for name in whole:
            torch.testing.assert_close(ddp[0][name], ddp[1][name], msg=name)  # DDP: the same on every rank
            torch.testing.assert_close(ddp[0][name], whole[name], rtol=1e-5, atol=1e-6, msg=f"k={k} {name}")
            torch.testing.assert_close(accumulated[name], whole[name], rtol=1e-5, atol=1e-6, msg=f"k={k} {name}")
