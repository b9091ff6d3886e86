"""The stability observatory's statistics (normlab/observatory.py) on hand-built activations, attention
maps and gradient norms with known answers, and the model's explicit attention map against the SDPA
forward it stands for. Its runs (CSV, results.json, W&B): tests/test_observatory_runs.py."""
import math

import pytest
import torch
from scipy import stats as scipy_stats

from normlab import observatory as obs
from normlab.callbacks.observatory import BlockGradNorms, metric_names, observe
from normlab.config import ModelConfig
from normlab.model.attention import MultiheadAttention
from normlab.model.stability import AttentionStability
from normlab.model.transformer import Seq2SeqTransformer
from normlab.private_api import module_hooks
from normlab.study.records import STATISTICS


def test_rms_and_max_abs_leave_pads_out():
    x = torch.tensor([[[3.0, -4.0], [100.0, 100.0]]])  # (1, 2, 2): token 1 is a pad
    real = torch.tensor([[True, False]])
    assert obs.rms(x, real) == pytest.approx(math.sqrt((9 + 16) / 2))
    assert obs.max_abs(x, real) == 4.0
    assert obs.max_abs(x) == 100.0


def test_kurtosis_of_a_gaussian_is_zero():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=g)  # 64 tokens of 4096 features: sd of the mean ~ √(24/4096)/8 ≈ 0.01
    assert abs(obs.excess_kurtosis(x)) < 0.05


def test_kurtosis_of_one_outlier_feature_is_the_formula():
    """One feature a among D zeros: m₄/m₂² = ((D−1)³ + 1) / (D(D−1)), whatever a: the measure grows
    towards D with a single outlier feature (the OSP paper's 1818 at D = 2048)."""
    for d in (4, 100, 2048):
        x = torch.zeros(3, d)
        x[:, 7 % d] = torch.tensor([1.0, 50.0, 1e4])
        exact = ((d - 1) ** 3 + 1) / (d * (d - 1)) - 3
        assert obs.excess_kurtosis(x) == pytest.approx(exact, rel=1e-5)  # fp32 moments
        assert obs.excess_kurtosis(x[:1]) == pytest.approx(scipy_stats.kurtosis(x[0].numpy(), fisher=True, bias=True))


def test_kurtosis_is_per_token_averaged_over_real_tokens():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 50, generator=g).exp()  # (B, T, D), log-normal: heavy tails
    real = torch.tensor([[True, True, False], [True, False, False]])
    rows = x[real].numpy()
    expected = sum(scipy_stats.kurtosis(r) for r in rows) / len(rows)  # scipy: Fisher, population moments
    assert obs.excess_kurtosis(x, real) == pytest.approx(expected, rel=1e-6)
    x[0, 1] = 5.0  # a token with no spread has no kurtosis: left out, not 0/0
    assert obs.excess_kurtosis(x, real) == pytest.approx((scipy_stats.kurtosis(rows[0]) + scipy_stats.kurtosis(rows[2])) / 2,
                                                         rel=1e-6)
    assert math.isnan(obs.excess_kurtosis(torch.ones(2, 5)))


def test_entropy_and_sink_of_hand_built_maps():
    n = 6
    uniform = torch.full((1, 2, 3, n), 1 / n)  # (B, H, T, S)
    assert obs.attention_entropy(uniform) == pytest.approx([math.log(n)] * 2)
    assert obs.sink_rate(uniform) == pytest.approx([1 / n] * 2)
    first = torch.zeros(1, 2, 3, n)
    first[..., 0] = 1.0
    assert obs.attention_entropy(first) == pytest.approx([0.0, 0.0])
    assert obs.sink_rate(first) == [1.0, 1.0]
    # head 0 all on position 0, head 1 uniform over the 4 keys that are not pads (p = 0 on the 2 pads)
    mixed = torch.cat([first[:, :1], torch.tensor([0.25] * 4 + [0.0] * 2).expand(1, 1, 3, n)], 1)
    assert obs.attention_entropy(mixed) == pytest.approx([0.0, math.log(4)])
    assert obs.sink_rate(mixed) == pytest.approx([1.0, 0.25])


def test_query_mask_leaves_pad_rows_out():
    p = torch.zeros(1, 1, 2, 4)
    p[0, 0, 0, 0] = 1.0  # a real query all on the sink
    p[0, 0, 1] = 0.25  # a pad query, uniform
    real = torch.tensor([[True, False]])
    assert obs.sink_rate(p, real) == [1.0] and obs.attention_entropy(p, real) == [0.0]
    assert obs.sink_rate(p) == [pytest.approx(0.625)]


def test_causal_rows_and_max_logit_over_visible_keys():
    """q = 0: every visible key has logit 0, so row i of a causal map is uniform over i + 1 keys."""
    from normlab.model.stability import attention_weights

    T = 5
    q, k = torch.zeros(1, 1, T, 4), torch.randn(1, 1, T, 4)
    s, p = attention_weights(q, k, None, True, None)
    assert obs.attention_entropy(p) == pytest.approx([sum(math.log(i + 1) for i in range(T)) / T])
    assert obs.sink_rate(p) == pytest.approx([sum(1 / (i + 1) for i in range(T)) / T])
    s = torch.tensor([[[[1.0, float("-inf")], [2.0, 9.0]]]])  # (1, 1, 2, 2): 9 is a pad query's
    assert obs.max_logit(s) == 9.0 and obs.max_logit(s, torch.tensor([[True, False]])) == 1.0


def _mha(**kw):
    torch.manual_seed(0)
    return MultiheadAttention(16, 4, **kw).eval()


@pytest.mark.parametrize("case", ["encoder", "causal", "cross", "sink", "softcap_sink", "qk_norm"])
def test_attention_map_is_what_the_forward_attends_with(case):
    """out_proj(p·V merged) from the map's probabilities equals the module's own (SDPA) forward, and its
    logits are q·k/√d_head: the map is the one the model used, masks, cap, sink and scale included."""
    from normlab.model.qk_norms import L2QKNorm

    g = torch.Generator().manual_seed(1)
    x, memory = torch.randn(2, 5, 16, generator=g), torch.randn(2, 7, 16, generator=g)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    kind = {"causal": "decoder_self", "cross": "cross"}.get(case, "encoder_self")
    cap = 3.0 if case == "softcap_sink" else None
    m = _mha(kind=kind, stability=AttentionStability(4, 4, 16, sink=True, logit_cap=cap) if "sink" in case
             else None, qk_norm=L2QKNorm(2.0) if case == "qk_norm" else None)
    args, kw = ((x, memory), {"key_padding_mask": pad}) if case == "cross" else \
        ((x,), {"causal": True}) if case == "causal" else ((x,), {"key_padding_mask": pad[:, :5]})
    s, p = m.attention_map(*args, **kw)
    _, _, v = m._qkv(*(args + (None,) * (2 - len(args))), None)
    out = m.out_proj((p @ v).transpose(1, 2).reshape(2, 5, 16))
    assert torch.allclose(out, m(*args, **kw), atol=1e-5)
    if case in ("encoder", "cross"):
        q = m.q_proj(x).view(2, 5, 4, 4).transpose(1, 2)
        k = m.k_proj(args[-1]).view(2, -1, 4, 4).transpose(1, 2)
        ref = (q @ k.transpose(-2, -1) / 2.0).masked_fill(pad[:, None, None, :k.size(2)], float("-inf"))
        assert torch.allclose(s, ref, atol=1e-5)
        assert p[1, :, :, 4:].abs().max() == 0  # padded keys get nothing


def test_grad_window_spike_score_and_state():
    w = obs.GradWindow(5)
    for v in (1.0, 2.0, 1.0, 1.0):
        w.add(torch.tensor([v, 3.0]))
    w.add(torch.tensor([10.0, float("inf")]))  # a spike in layer 0; a non-finite norm enters no median
    last, spike = w.report()
    assert last[0] == 10.0 and math.isnan(last[1])
    assert spike == [10.0, 1.0]  # layer 0: 10 / median(1, 2, 1, 1, 10) = 10; layer 1: 3 / 3
    w.add(torch.tensor([1.0, 3.0]))  # the window slides: (2, 1, 1, 10, 1), median 1
    restored = obs.GradWindow(5)
    restored.load_state_dict(w.state_dict())
    for window in (w, restored):
        last, spike = window.report()
        assert last == [1.0, 3.0] and spike == [1.0, 1.0]  # only the updates since the last report count
    assert obs.GradWindow(3).report() is None


def _model(**kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2, encoder_heads=2,
                      decoder_heads=2, encoder_ffn=32, decoder_ffn=32, dropout=0.0, attention_dropout=0.0, **kw)
    return Seq2SeqTransformer(cfg)


def test_block_grad_norms_are_each_blocks_norm():
    model = _model()
    src, tgt = torch.randint(4, 40, (3, 6)), torch.randint(4, 40, (3, 5))
    model(src, tgt).logsumexp(-1).sum().backward()
    params = list(model.parameters())
    blocks, total = BlockGradNorms()(model, params)
    for (name, block), got in zip(model.residual_blocks(), blocks.tolist()):
        ref = torch.cat([p.grad.flatten() for p in block.parameters() if p.grad is not None]).norm().item()
        assert got == pytest.approx(ref, rel=1e-5), name
    assert total.item() == pytest.approx(torch.cat([p.grad.flatten() for p in params]).norm().item(), rel=1e-5)


def test_observe_covers_every_block_and_removes_its_hooks():
    model = _model().eval()
    src = torch.tensor([[5, 6, 7, 8], [9, 10, model.cfg.pad_id, model.cfg.pad_id]])
    tgt = torch.tensor([[2, 11, 12], [2, 13, model.cfg.pad_id]])
    layers = observe(model, src, tgt)
    assert list(layers) == [n for n, _ in model.residual_blocks()]
    assert set(layers["dec.1.cross_attn"]) == {"rms", "max_abs", "kurtosis", "out_rms", "out_max_abs", "max_logit",
                                               "entropy_h0", "entropy_h1", "sink_h0", "sink_h1"}
    assert set(layers["enc.0.ffn"]) == {"rms", "max_abs", "kurtosis", "out_rms", "out_max_abs"}
    # the names a study's obs.<stack>.<statistic> claim may read (refused when mistyped) are these, and the
    # gradient's two the callback adds at a validation
    measured = {k.rpartition("_h")[0] if k.startswith(("entropy_h", "sink_h")) else k for s in layers.values() for k in s}
    assert measured | {"grad_norm", "grad_spike"} == set(STATISTICS)
    assert not any(module_hooks(m) for m in model.modules())
    # the residual stream after enc.1.ffn is the encoder's output before its final norm: the real tokens'
    x = model.encoder.embed(src)
    mask = src.eq(model.cfg.pad_id)
    for layer in model.encoder.layers:
        x = layer(x, mask)
    assert layers["enc.1.ffn"]["rms"] == pytest.approx(obs.rms(x, ~mask), rel=1e-6)
    assert layers["enc.1.ffn"]["kurtosis"] == pytest.approx(obs.excess_kurtosis(x, ~mask), rel=1e-6)
    # the decoder's first self-attention sees one key at the first query: log 1 = 0 there
    assert 0 < layers["dec.0.self_attn"]["entropy_h0"] < math.log(3)


def test_metric_names_one_section_per_statistic():
    names = metric_names({"enc.3.self_attn": {"entropy_h0": 1.0, "sink_h1": 0.5, "max_logit": 7.0, "kurtosis": 2.0}})
    assert names == {"obs_entropy/enc.3.self_attn.h0": 1.0, "obs_sink/enc.3.self_attn.h1": 0.5,
                     "obs_max_logit/enc.3.self_attn": 7.0, "obs_kurtosis/enc.3.self_attn": 2.0}


@pytest.mark.parametrize("fused", [True, False], ids=["fused Adam", "foreach Adam"])
def test_gradient_norms_under_fp16_loss_scaling_are_the_true_ones(fused):
    """fp16-mixed: the GradScaler multiplies the loss by S. Lightning unscales the gradients before
    on_before_optimizer_step unless the optimizer unscales inside its own step (fused Adam, the GPU
    default without clipping); then they still carry S there. The module's update norm, the observatory's
    per-block norms and the diagnostics' are the ones of the same backward without scaling, either way.
    (Lightning refuses fp16 on CPU: its two paths are reproduced by hand around the real hooks.)"""
    from types import SimpleNamespace

    from normlab.callbacks.diagnostics import grad_norms
    from normlab.callbacks.observatory import Observatory
    from normlab.lit_module import Seq2SeqModule
    from normlab.private_api import pending_loss_scale
    from normlab.settings import EvalSpec, OptimSpec

    module = Seq2SeqModule(_model().cfg.to_dict(), optim=OptimSpec(), eval=EvalSpec())
    src, tgt = torch.randint(4, 40, (3, 6)), torch.randint(4, 40, (3, 5))
    module.model(src, tgt).logsumexp(-1).sum().backward()
    params = list(module.parameters())
    true_total = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).norm().item()
    true_blocks = [torch.cat([p.grad.flatten() for p in b.parameters()]).norm().item() for _, b in module.model.residual_blocks()]
    module.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler.scale(module.model(src, tgt).logsumexp(-1).sum()).backward()
    optimizer = torch.optim.Adam(params, **({"fused": True} if fused else {"foreach": True}))
    if not fused:
        scaler.unscale_(optimizer)  # what Lightning's MixedPrecision does before the hooks
    plugin = SimpleNamespace(scaler=scaler, clip_gradients=lambda *a, **k: None)
    trainer = SimpleNamespace(precision_plugin=plugin, is_global_zero=True, global_step=0, gradient_clip_val=None,
                              gradient_clip_algorithm=None)
    module._trainer = trainer
    observatory = Observatory()
    observatory.on_before_optimizer_step(trainer, module, optimizer)  # callbacks first, as Lightning calls them
    diagnostics = grad_norms(module.model, pending_loss_scale(plugin, optimizer))
    module.configure_gradient_clipping(optimizer, None, None)
    observatory.on_train_batch_end(trainer, module, None, None, 0)
    assert module.stats.grad_norm == pytest.approx(true_total, rel=1e-5)
    assert observatory.grads.report()[0] == pytest.approx(true_blocks, rel=1e-5)
    assert list(diagnostics.values()) == pytest.approx(true_blocks, rel=1e-5)
