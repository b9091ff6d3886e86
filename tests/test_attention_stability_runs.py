"""The output-logit soft-cap (model.logit_softcap, Gemma 2) inside the chunked training loss, against the
loss of c·tanh(x Wᵀ/c) written out in float64 with autograd's gradient; and a 2-step run of each
attention-stability scheme (model/stability.py) through the training entry point."""
import json

import pytest
import torch

from normlab import losses
from normlab.losses import model_loss, projected_label_smoothed_nll
from normlab.model.transformer import Seq2SeqTransformer

from test_attention_features import source, tiny


def reference_loss(x, weight, target, eps, pad, cap, z):
    # uniform label smoothing (Szegedy et al. 2016) of the capped logits, plus z·log²Z, summed over
    # the non-pad targets; autograd differentiates it
    logits = cap * torch.tanh(x @ weight.T / cap)  # (N, V)
    lprobs = logits.log_softmax(-1)
    keep = target.ne(pad).double()
    V = weight.size(0)
    smoothed = -((1 - eps) * lprobs.gather(1, target[:, None]).squeeze(1) + eps / V * lprobs.sum(-1))
    return (keep * (smoothed + z * logits.logsumexp(-1).square())).sum()


@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_the_chunked_loss_of_capped_logits_and_its_gradient(z, monkeypatch):
    g = torch.Generator().manual_seed(0)
    N, D, V, cap = 11, 6, 9, 1.5
    x = (torch.randn(N, D, generator=g, dtype=torch.float64) * 2).requires_grad_()
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) * 2).requires_grad_()
    target = torch.randint(1, V, (N,), generator=g)
    target[[2, 7]] = 0  # pads
    monkeypatch.setitem(losses.CHUNK_ELEMENTS, "cpu", 4 * V)  # chunks of 4 rows: 3 chunks
    loss, _, _ = projected_label_smoothed_nll(x, weight, target, 0.1, 0, z_loss=z, softcap=cap)
    gx, gw = torch.autograd.grad(loss, (x, weight))
    expected = reference_loss(x, weight, target, 0.1, 0, cap, z)
    ex, ew = torch.autograd.grad(expected, (x, weight))
    for actual, wanted in ((loss, expected), (gx, ex), (gw, ew)):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-10)
    uncapped = projected_label_smoothed_nll(x, weight, target, 0.1, 0, z_loss=z)[0]
    assert (uncapped - loss).abs() > 1e-2  # the cap acts at this scale


def test_training_and_validation_score_the_logits_decoding_sees():
    # model_loss reads the model's cap: its loss is the one of the capped logits the model decodes with.
    torch.manual_seed(0)
    model = Seq2SeqTransformer(tiny(logit_softcap=0.5)).double().eval()
    src = source()
    tgt_in, tgt_out = src[:, :-1], src[:, 1:]
    loss = model_loss(model, src, tgt_in, tgt_out, 0.1, 0)[0]
    lprobs = model(src, tgt_in).log_softmax(-1)  # (B, T, V), capped in the output projection
    keep = tgt_out.ne(0).double()
    V = lprobs.size(-1)
    expected = (keep * -(0.9 * lprobs.gather(-1, tgt_out[..., None]).squeeze(-1) + 0.1 / V * lprobs.sum(-1))).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)


SCHEMES = ["model.attn_gate=headwise", "model.attn_gate=elementwise", "model.attn_sink=true",
           "model.attn_softcap=50", "model.logit_softcap=30", "model.k_norm=true", "model.v_norm=true"]


@pytest.mark.integration
@pytest.mark.parametrize("override", SCHEMES)
def test_a_two_step_run_of_each_scheme(override, small_corpus, tmp_path):
    from normlab.checkpoint import load_model, resolve_checkpoint
    from normlab.train import run

    from conftest import compose_cfg, tiny_overrides

    run_dir = tmp_path / "run"
    run(compose_cfg(tiny_overrides(small_corpus, run_dir, tmp_path / "cache")
                    + [override, "trainer.max_steps=2", "eval.valid_bleu=false", "eval.test=false"]))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and results["steps"] == 2
    model, _ = load_model(resolve_checkpoint(run_dir))
    key, value = override.split("=")
    assert str(getattr(model.cfg, key.split(".")[1])).lower() in (value, f"{value}.0")
