"""Diagnostics: the output-change probe, parameter and gradient statistics per sub-layer."""
import copy

import pytest
import torch

from normlab.callbacks.diagnostics import grad_norms, parameter_stats
from normlab.config import ModelConfig
from normlab.model.transformer import Seq2SeqTransformer
from normlab.probes import output_change

V, PAD = 31, 0


def model_of(**kw):
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_heads=2,
                decoder_heads=2, encoder_ffn=32, decoder_ffn=32, max_positions=64, dropout=0.2)
    return Seq2SeqTransformer(ModelConfig(**{**base, **kw}))


def batch():
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, V, (3, 7), generator=g), torch.randint(3, V, (3, 5), generator=g)
    src[0, 5:], tgt[1, 3:] = PAD, PAD
    return src, tgt


def test_output_change_matches_a_perturbed_copy_and_restores_parameters():
    model = model_of(norm={"placement": "post"}).train()
    src, tgt = batch()
    before = copy.deepcopy(model.state_dict())
    change = output_change(model, src, tgt, delta=1e-3, seed=5)
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # restored bit for bit
    ref, moved = copy.deepcopy(model).eval(), copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in moved.parameters():
            p -= 1e-3 * torch.sign(torch.randn(p.shape, generator=g))
        m0, pad = ref.encode(src)
        m1, _ = moved.encode(src)
        d0, d1 = ref.decoder(tgt, m0, pad), moved.decoder(tgt, m1, pad)
    assert change["encoder"] == pytest.approx((m1 - m0)[src.ne(PAD)].norm().item(), rel=1e-4)
    assert change["decoder"] == pytest.approx((d1 - d0)[tgt.ne(PAD)].norm().item(), rel=1e-4)
    assert change["decoder"] > 0
    assert output_change(model, src, tgt, delta=0.0) == {"encoder": 0.0, "decoder": 0.0}


def test_parameter_stats_scalenorm_fixnorm_and_admin():
    sn = model_of(norm={"type": "scalenorm", "placement": "pre", "fixnorm": True})
    with torch.no_grad():
        sn.decoder.layers[1].cross_attn.norm.g.fill_(1.5)
    stats = parameter_stats(sn)
    assert stats["diag/dec.1.cross_attn/g"] == 1.5
    assert stats["diag/enc.0.ffn/g"] == pytest.approx(4.0)  # √16
    assert {"diag/enc.final/g", "diag/dec.final/g"} <= set(stats)
    assert "diag/output/g" not in stats  # the decoder's final g is the output scale (FixNorm)
    assert len([k for k in stats if k.endswith("/g")]) == 2 * 2 + 2 * 3 + 2
    post = parameter_stats(model_of(norm={"type": "scalenorm", "placement": "post", "fixnorm": True}))
    assert post["diag/output/g"] == pytest.approx(4.0)
    admin = model_of(init="admin")
    with torch.no_grad():
        admin.encoder.layers[1].ffn.omega.copy_(torch.linspace(1.0, 3.0, 16))
    stats = parameter_stats(admin)
    assert (stats["diag/enc.1.ffn/omega_min"], stats["diag/enc.1.ffn/omega_max"]) == (1.0, 3.0)
    assert stats["diag/enc.1.ffn/omega_mean"] == pytest.approx(2.0)
    assert not any(k.endswith("/g") for k in stats)


def test_grad_norms_per_sublayer():
    model = model_of(norm={"placement": "pre"})
    src, tgt = batch()
    model(src, tgt).logsumexp(-1).mean().backward()
    norms = grad_norms(model)
    assert len(norms) == 2 * 2 + 2 * 3
    block = model.decoder.layers[0].cross_attn
    expected = torch.sqrt(sum((p.grad ** 2).sum() for p in block.parameters())).item()
    assert norms["diag/dec.0.cross_attn/grad_norm"] == pytest.approx(expected, rel=1e-5)


ARMS = {"deepnorm": {"norm": {"placement": "deepnorm"}}, "subln": {"norm": {"placement": "subln"}},
        "sandwich": {"norm": {"placement": "sandwich", "type": "scalenorm"}},
        "rezero": {"norm": {"placement": "rezero", "type": "none"}},
        "resi_dual": {"norm": {"placement": "resi_dual", "type": "scalenorm"}},
        "dyt": {"norm": {"placement": "pre", "type": "dyt"}}, "dlcl": {"layer_aggregation": "dlcl"},
        "dwa": {"layer_aggregation": "dwa"},
        "b2t": {"norm": {"placement": "b2t"}}, "reordered": {"norm": {"placement": "reordered"}},
        "pre_scaled": {"norm": {"placement": "pre_scaled"}}, "mix": {"norm": {"placement": "mix", "mix_ratio": 0.5}},
        "hybrid": {"norm": {"placement": "hybrid", "type": "scalenorm"}},
        "hybrid_star": {"norm": {"placement": "hybrid_star", "type": "scalenorm"}},
        "derf_qk_value_residual": {"norm": {"placement": "pre", "type": "derf"}, "qk_norm": "l2",
                                   "qk_norm_scale_init": 3.0, "value_residual": True},
        "hyper": {"norm": {"placement": "pre"}, "residual": "hyper", "residual_mixing": "dynamic"},
        "mhc": {"norm": {"placement": "subln"}, "residual": "mhc"}}


@pytest.mark.parametrize("arm", list(ARMS))
def test_diagnostics_and_probe_see_every_block_of_every_scheme(arm):
    from normlab.callbacks.diagnostics import RatioHooks

    model = model_of(**ARMS[arm]).train()
    with torch.no_grad():
        for _, b in model.residual_blocks():
            if b.scale is not None:
                b.scale.fill_(0.5)  # ReZero's a: F matters
    names = [n for n, _ in model.residual_blocks()]
    assert len(names) == 2 * 2 + 2 * 3
    src, tgt = batch()
    change = output_change(model, src, tgt)
    assert all(0 < v < float("inf") for v in change.values())
    hooks = RatioHooks(model)
    model(src, tgt).logsumexp(-1).mean().backward()
    ratios = hooks.close()
    assert set(ratios) == set(names) and all(0 < r < float("inf") for r in ratios.values())
    assert set(grad_norms(model)) == {f"diag/{n}/grad_norm" for n in names}
    stats = parameter_stats(model)
    if arm == "sandwich":
        assert len([k for k in stats if k.endswith("/g_out")]) == len(names)
    if arm == "rezero":
        assert [stats[f"diag/{n}/a"] for n in names] == [0.5] * len(names)
    if arm == "dyt":
        assert stats["diag/enc.0.ffn/dyt_alpha"] == 0.5
    if arm == "hybrid":  # the attention blocks' norms are inside the attention (QKV-norm): g on the FFNs'
        assert {k.split("/")[1] for k in stats if k.endswith("/g")} == {n for n in names if n.endswith("ffn")} | {
            "enc.final", "dec.final"}
    if arm == "hybrid_star":  # the first layer's attentions are pre-norm: their input norms have a g too
        assert {k.split("/")[1] for k in stats if k.endswith("/g")} == {
            n for n in names if n.endswith("ffn") or ".0." in n} | {"enc.final", "dec.final"}
    if arm == "derf_qk_value_residual":
        assert (stats["diag/enc.0.ffn/derf_alpha"], stats["diag/enc.0.ffn/derf_shift"]) == (0.5, 0.0)
        assert [stats[f"diag/{n}/qk_g"] for n in names if "attn" in n] == [3.0] * (2 + 2 * 2)
        assert {n for n in names if f"diag/{n}/vr_lambda1" in stats} == {n for n in names if n.endswith("self_attn")}
        assert stats["diag/dec.1.self_attn/vr_lambda2"] == 0.5
    if arm == "resi_dual":
        assert {"diag/enc.final/g", "diag/dec.final/g"} <= set(stats)
