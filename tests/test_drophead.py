"""DropHead limit tests (p = 0, p = 1, eval), expectation (Monte Carlo), switches; schedules."""
import math
from types import SimpleNamespace

import pytest
import torch

from normlab.callbacks.drophead_schedule import DropHeadSchedule
from normlab.config import ModelConfig
from normlab.model.attention import MultiheadAttention
from normlab.model.transformer import Seq2SeqTransformer
from normlab.regularizers.drophead import DropHead, drophead_mask, set_drophead_p
from normlab.regularizers.rate_schedules import schedule_value
from normlab.settings import OptimSpec

V = 29


def cfg(p=0.0, dropout=0.1, **switches) -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_heads=4,
                       decoder_heads=4, encoder_ffn=24, decoder_ffn=24, max_positions=32, dropout=dropout,
                       regularizer=dict(drophead=p, **switches))


def batch(B=3, S=7, T=6):
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(3, V, (B, S), generator=g), torch.randint(3, V, (B, T), generator=g)
    src[0, 4:] = 0
    return src, tgt


@pytest.mark.parametrize("p", [0.0, 0.3, 0.9, 1.0])
def test_mask_rows_sum_to_h_never_empty_never_nan(p):
    H = 4
    m = drophead_mask(5000, H, p, generator=torch.Generator().manual_seed(1))
    assert m.shape == (5000, H) and torch.isfinite(m).all()
    kept = m.gt(0).sum(1)
    assert kept.min() >= 1
    assert torch.allclose(m.sum(1), torch.full((5000,), float(H)))
    assert torch.allclose(m[m > 0], (H / kept.float()).repeat_interleave(kept))  # rescale H / kept
    if p == 1.0:
        assert kept.eq(1).all()
    if p == 0.0:
        assert m.eq(1).all()


@pytest.mark.parametrize("p", [0.2, 0.6])
def test_mask_expectation_is_one_monte_carlo(p):
    n, H = 20000, 8
    m = drophead_mask(n, H, p, generator=torch.Generator().manual_seed(2))
    mean, se = m.mean(0), m.std(0) / math.sqrt(n)
    assert (mean - 1).abs().max() < 5 * se.max()
    assert m.eq(0).float().mean().item() == pytest.approx(p, abs=0.02)  # heads dropped at rate ~p


def test_attention_output_expectation_unchanged_with_fused_sdpa():
    torch.manual_seed(0)
    att = MultiheadAttention(16, 4, kind="encoder_self", drophead=DropHead(0.5))
    x = torch.randn(1, 5, 16).expand(4000, 5, 16)  # one sentence, many independent masks
    pad = torch.zeros(4000, 5, dtype=torch.bool)
    pad[:, 4] = True
    att.eval()
    ref = att(x[:1], key_padding_mask=pad[:1])
    att.train()
    out = att(x, key_padding_mask=pad)
    assert torch.isfinite(out).all()
    assert len(torch.unique(out[:, 0, 0].round(decimals=5))) > 4  # per-example masks
    se = out.std(0) / math.sqrt(out.size(0))
    assert ((out.mean(0) - ref[0]).abs() <= 5 * se + 1e-6).all()


def test_p0_equals_the_model_without_drophead_same_rng():
    src, tgt = batch()
    torch.manual_seed(0)
    plain = Seq2SeqTransformer(cfg(0.0)).train()
    assert not any(isinstance(m, DropHead) for m in plain.modules())  # p = 0: no module at all
    torch.manual_seed(0)
    hooked = Seq2SeqTransformer(cfg(0.3)).train()
    assert set_drophead_p(hooked, 0.0) == 2 * 2 + 2  # every attention module of 2+2 layers
    torch.manual_seed(4)
    a = plain(src, tgt)
    state = torch.get_rng_state()
    torch.manual_seed(4)
    assert torch.equal(a, hooked(src, tgt))
    assert torch.equal(state, torch.get_rng_state())  # p = 0: no mask is drawn


def test_eval_unaffected_and_training_changes_output():
    src, tgt = batch()
    torch.manual_seed(0)
    plain = Seq2SeqTransformer(cfg(0.0, dropout=0.0)).eval()
    torch.manual_seed(0)
    dh = Seq2SeqTransformer(cfg(1.0, dropout=0.0)).eval()
    assert torch.equal(plain(src, tgt), dh(src, tgt)) and torch.equal(dh(src, tgt), dh(src, tgt))
    dh.train()
    out = dh(src, tgt)  # p = 1: one head per row survives
    assert torch.isfinite(out).all() and not torch.allclose(out, plain(src, tgt))


@pytest.mark.parametrize("switch,kind", [("drophead_encoder_self", "encoder_self"),
                                         ("drophead_decoder_self", "decoder_self"), ("drophead_cross", "cross")])
def test_each_attention_kind_is_switchable(switch, kind):
    m = Seq2SeqTransformer(cfg(0.3, **{switch: False}))
    hooked = {a.kind for a in m.modules() if isinstance(a, MultiheadAttention) and isinstance(a.drophead, DropHead)}
    assert hooked == {"encoder_self", "decoder_self", "cross"} - {kind}


# ---- schedules ------------------------------------------------------------------------------
def v_formula(step, p_start, p_end, warmup, total):
    # Zhou et al. 2020's V, written out: linear from (0, p_start) to (warmup, 0), then to (total, p_end)
    if step <= warmup:
        return p_start + (0.0 - p_start) * step / warmup
    return 0.0 + (p_end - 0.0) * (step - warmup) / (total - warmup)


@pytest.mark.parametrize("step", [0, 1, 37, 100, 101, 550, 999, 1000])
def test_v_shape_values_against_the_formula(step):
    assert schedule_value("v_shape", step, 0.3, total=1000, warmup=100) == pytest.approx(
        v_formula(step, 0.3, 0.3, 100, 1000))
    assert schedule_value("v_shape", step, 0.2, total=1000, warmup=100, p_start=0.5) == pytest.approx(
        v_formula(step, 0.5, 0.2, 100, 1000))
    assert schedule_value("constant", step, 0.3) == 0.3


def test_v_shape_endpoints():
    assert schedule_value("v_shape", 100, 0.3, total=1000, warmup=100) == 0.0
    assert schedule_value("v_shape", 1000, 0.3, total=1000, warmup=100) == pytest.approx(0.3)
    assert schedule_value("v_shape", 1200, 0.3, total=1000, warmup=100) == pytest.approx(0.3)  # stays
    with pytest.raises(ValueError):
        schedule_value("triangle", 1, 0.3)


def test_callback_sets_p_from_global_step_and_defaults_to_lr_warmup():
    m = Seq2SeqTransformer(cfg(0.3))
    module = SimpleNamespace(modules=m.modules, log=lambda *a, **k: None)
    cb = DropHeadSchedule(p=0.3, schedule="v_shape", optim=OptimSpec(warmup=10))  # the run's (RunValues)
    for gs in (0, 5, 9, 10, 49):
        cb.on_train_batch_start(SimpleNamespace(global_step=gs, max_steps=50), module, None, 0)
        expected = v_formula(gs + 1, 0.3, 0.3, 10, 50)  # schedule step = optimizer steps done + 1
        ps = [a.drophead.p for a in m.modules() if isinstance(a, MultiheadAttention)]
        assert len(ps) == 6 and ps == pytest.approx([expected] * 6)
    # stateless: a fresh callback (a resumed run) at the same global_step sets the same p
    fresh = DropHeadSchedule(p=0.3, schedule="v_shape", optim=OptimSpec(warmup=10))
    fresh.on_train_batch_start(SimpleNamespace(global_step=49, max_steps=50), module, None, 0)
    assert fresh.last_p == cb.last_p
