"""Hyper-connections (Zhu et al. 2024) and mHC (Xie et al. 2025), model.residual=hyper|mhc (issue 20):
each block against its formula with hand-set weights and an independent computation here (float64,
stream by stream), Sinkhorn's doubly-stochastic mixing, pre-LN at init, cached == uncached decoding,
LayerDrop passing the streams through, pruning == skipping through save and load, refusals."""
import math

import pytest
import torch
from torch import nn

from normlab.config import ConfigError, ModelConfig
from normlab.model.hyper import HyperConnection, ManifoldHyperConnection, sinkhorn
from normlab.model.residual import ResidualBlock
from normlab.model.transformer import FeedForward, Seq2SeqTransformer
from normlab.regularizers.pruning import prune

from test_attention_features import check_cached_decoding
from test_schemes_recent import check_pruned_is_skipped

V, PAD = 13, 0
VARIANTS = [("hyper", "static"), ("hyper", "dynamic"), ("mhc", "static"), ("mhc", "dynamic")]


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=8, encoder_layers=3, decoder_layers=3, encoder_heads=2, decoder_heads=2,
                encoder_ffn=12, decoder_ffn=12, max_positions=32, norm={"placement": "pre"})
    return ModelConfig(**{**base, **kw})


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(3, V, (4, 6), generator=g), torch.randint(3, V, (4, 5), generator=g)
    src[1, 4:] = PAD
    return src, tgt


def randomise_(module: nn.Module, seed=1) -> nn.Module:
    # Every hyper-connection weight away from its init (the streams then differ), norm gains too.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "hyper." in name or name.startswith(("alpha", "mix", "beta", "w", "scale", "b_", "phi", "norm")):
                p.add_(torch.rand(p.shape, generator=g) - 0.5)
    return module


def model(residual, mixing, seed=0, **kw):
    torch.manual_seed(seed)
    return randomise_(Seq2SeqTransformer(tiny(residual=residual, residual_mixing=mixing, **kw))).eval()


# ---- the block against the papers' formulas -------------------------------------------------------
def layer_norm(x, norm):  # float64 LayerNorm with the module's affine parameters
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) / torch.sqrt(var + norm.eps) * norm.weight.double() + norm.bias.double()


def ffn(f, x):
    return torch.relu(x @ f.fc1.weight.double().T + f.fc1.bias.double()) @ f.fc2.weight.double().T + f.fc2.bias.double()


def block(connection, d=8):
    torch.manual_seed(0)
    b = ResidualBlock(FeedForward(d, 12, 0.0), nn.LayerNorm(d), d, "pre", 0.0, hyper=connection)
    return randomise_(b).eval()


def per_token(b, H, weights):
    # The block token by token in float64: weights(Ht) gives the read vector, the mixed streams and
    # the write vector for the token's (n, d) matrix Ht; the branch is pre-norm's FFN(N(read·Ht)).
    Hd = H.double()
    out = torch.zeros_like(Hd)
    for bi in range(H.shape[1]):
        for t in range(H.shape[2]):
            read, skip, write = weights(Hd[:, bi, t])
            out[:, bi, t] = skip + write[:, None] * ffn(b.sublayer, layer_norm(read @ Hd[:, bi, t], b.norm))[None]
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_hyper_connection_is_the_papers_formula(dynamic):
    n, d = 3, 8
    b = block(HyperConnection(n, d, index=4, dynamic=dynamic, norm_cfg=tiny().norm))
    hc = b.hyper

    def weights(Ht):  # H ← A_rᵀH + βᵀF(α_mᵀH)
        a_m, a_r, beta = hc.alpha.double(), hc.mix.double(), hc.beta.double()
        if dynamic:  # Zhu et al. eqs. 11-13: offsets tanh(H̄W) scaled by s_α, s_β
            Hbar, w = layer_norm(Ht, hc.norm), hc.w.double()
            a_m = a_m + hc.scale[0].double() * torch.tanh(Hbar @ w[:, 0])
            beta = beta + hc.scale[1].double() * torch.tanh(Hbar @ w[:, 1])
            a_r = a_r + hc.scale[0].double() * torch.tanh(Hbar @ w[:, 2:])
        return a_m, a_r.T @ Ht, beta

    H = torch.randn(n, 2, 5, d, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(b(H).double(), per_token(b, H, weights), atol=1e-5, rtol=1e-5)


def sinkhorn_reference(m, iters=20):
    m = torch.exp(m.double())
    for _ in range(iters):
        m = m / m.sum(1, keepdim=True)
        m = m / m.sum(0, keepdim=True)
    return m


@pytest.mark.parametrize("dynamic", [False, True])
def test_mhc_is_the_papers_formula(dynamic):
    n, d = 3, 8
    b = block(ManifoldHyperConnection(n, d, dynamic=dynamic, eps=1e-5))
    c = b.hyper

    def weights(Ht):  # H ← H_res·H + H_postᵀF(H_pre·H)
        pre, post, res = c.b_pre.double(), c.b_post.double(), c.b_res.double()
        if dynamic:  # Xie et al. eqs. 7-8: x̃ = RMSNorm(vec(x)), H̃ = α·x̃φ + b
            v = Ht.reshape(-1)
            z = (v / torch.sqrt(v.pow(2).mean() + c.norm.eps) * c.norm.weight.double()) @ c.phi.double()
            pre = pre + c.scale[0].double() * z[:n]
            post = post + c.scale[1].double() * z[n:2 * n]
            res = res + c.scale[2].double() * z[2 * n:].reshape(n, n)
        return torch.sigmoid(pre), sinkhorn_reference(res) @ Ht, 2 * torch.sigmoid(post)

    H = torch.randn(n, 2, 5, d, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(b(H).double(), per_token(b, H, weights), atol=1e-5, rtol=1e-5)


def test_sinkhorn_gives_doubly_stochastic_matrices_per_token():
    # 20 iterations (mHC's t_max): columns sum to 1 after the last step; rows converge geometrically,
    # to rounding for logits of spread 0.5, to 1e-3 for spread 1 (at spread 2: ~2e-2)
    for spread, rows in ((0.5, 1e-6), (1.0, 1e-3)):
        m = sinkhorn(spread * torch.randn(4, 4, 50, 5, generator=torch.Generator().manual_seed(0)))
        assert (m > 0).all()
        torch.testing.assert_close(m.sum(0), torch.ones(4, 50, 5), atol=1e-6, rtol=0)
        torch.testing.assert_close(m.sum(1), torch.ones(4, 50, 5), atol=rows, rtol=0)
    torch.testing.assert_close(sinkhorn(torch.zeros(4, 4)), torch.full((4, 4), 0.25), atol=0, rtol=0)
    # inside a trained-looking mHC model: every block's H_res, every token
    m = model("mhc", "dynamic")
    src, _ = batch()
    h = m.encoder.stream_in(m.encoder.embed(src))
    _, res, _ = m.encoder.layers[0].self_attn.hyper.weights(h)
    assert res.shape == (4, 4, *src.shape)
    torch.testing.assert_close(res.sum(0), torch.ones(4, *src.shape), atol=1e-4, rtol=0)
    torch.testing.assert_close(res.sum(1), torch.ones(4, *src.shape), atol=1e-4, rtol=0)


# ---- initialisation: pre-LN ------------------------------------------------------------------------
@pytest.mark.parametrize("residual, mixing", VARIANTS)
def test_at_init_every_stream_is_pre_lns_stream_bit_for_bit(residual, mixing):
    torch.manual_seed(0)
    pre = Seq2SeqTransformer(tiny()).eval()
    hc = Seq2SeqTransformer(tiny(residual=residual, residual_mixing=mixing)).eval()
    missing, unexpected = hc.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected and all(".hyper." in k for k in missing)
    src, tgt = batch()
    for a, b in ((hc.encoder, pre.encoder),):
        streams = a.aggregation(a.layers, a.stream_in(a.embed(src)), src.eq(PAD))
        one = b.aggregation(b.layers, b.embed(src), src.eq(PAD))
        assert streams.shape == (4, *one.shape)
        assert all(torch.equal(s, one) for s in streams)  # n copies of pre-LN's stream
    memory, pad = hc.encode(src)
    streams = hc.decoder.aggregation(hc.decoder.layers, hc.decoder.stream_in(hc.decoder.embed(tgt)), memory, pad, None)
    ref = pre.decoder.aggregation(pre.decoder.layers, pre.decoder.embed(tgt), memory, pad, None)
    assert all(torch.equal(s, ref) for s in streams)
    # the final norm reads the streams' sum, 4x: LayerNorm's ε is the only difference (ε/16 for ε)
    torch.testing.assert_close(hc(src, tgt), pre(src, tgt), atol=2e-5, rtol=0)
    torch.manual_seed(0)
    pre = Seq2SeqTransformer(tiny(norm={"placement": "pre", "eps": 1e-12})).eval()
    hc = Seq2SeqTransformer(tiny(residual=residual, residual_mixing=mixing, norm={"placement": "pre", "eps": 1e-12}))
    hc.load_state_dict(pre.state_dict(), strict=False)
    torch.testing.assert_close(hc.eval()(src, tgt), pre(src, tgt), atol=1e-6, rtol=0)


def test_hyper_init_is_the_papers_eq_14():
    m = Seq2SeqTransformer(tiny(residual="hyper", encoder_layers=3, decoder_layers=2))
    reads = [b.hyper.alpha.argmax().item() for _, b in m.encoder.residual_blocks("enc")]
    assert reads == [0, 1, 2, 3, 0, 1]  # e_{k mod n}, k the block's index in its stack
    reads = [b.hyper.alpha.argmax().item() for _, b in m.decoder.residual_blocks("dec")]
    assert reads == [0, 1, 2, 3, 0, 1]
    hc = m.encoder.layers[0].ffn.hyper
    assert torch.equal(hc.alpha, torch.tensor([0.0, 1, 0, 0])) and torch.equal(hc.mix, torch.eye(4))
    assert torch.equal(hc.beta, torch.ones(4))


# ---- decoding, LayerDrop, pruning, checkpoints ----------------------------------------------------
@pytest.mark.parametrize("residual, mixing", VARIANTS)
def test_cached_decoding_equals_uncached(residual, mixing):
    m = model(residual, mixing, seed=1)
    src, _ = batch(2)
    tgt = torch.randint(3, V, (4, 6), generator=torch.Generator().manual_seed(3))
    check_cached_decoding(m, src, tgt)


@pytest.mark.parametrize("residual, mixing", [("hyper", "dynamic"), ("mhc", "dynamic")])
def test_a_layerdrop_skipped_layer_passes_the_streams_through(residual, mixing):
    reg = dict(encoder_layerdrop=1.0, decoder_layerdrop=1.0)
    m = model(residual, mixing, encoder_layers=4, decoder_layers=4, regularizer=reg).train()
    src, tgt = batch()
    h = m.encoder.stream_in(m.encoder.embed(src))
    skipped = list(m.encoder.layers)[0]
    assert torch.equal(skipped(h, src.eq(PAD)), h)  # the (n, B, T, d) streams, unchanged
    memory, _ = m.encode(src)
    assert m.encoder.layers.last_kept == []
    torch.testing.assert_close(memory, m.encoder.final_norm(m.encoder.stream_out(h)))
    m.encoder.layers.p = m.decoder.layers.p = 0.5  # the draws set: layers 1, 3 skipped (u < p), 0, 2 run
    m.encoder.layers._uniforms = m.decoder.layers._uniforms = lambda: torch.tensor([0.9, 0.1, 0.7, 0.2])
    out = m(src, tgt)
    ke, kd = m.encoder.layers.last_kept, m.decoder.layers.last_kept
    assert ke == kd == [0, 2]
    out.logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in m.parameters())  # skipped blocks' weights too (DDP)
    with torch.no_grad():
        torch.testing.assert_close(out, prune(m, ke, kd).eval()(src, tgt))


@pytest.mark.parametrize("residual, mixing", VARIANTS)
def test_pruned_equals_skipped_and_the_checkpoint_rebuilds(residual, mixing, tmp_path):
    m = model(residual, mixing, encoder_layers=4, decoder_layers=4)
    src, tgt = batch()
    loaded = check_pruned_is_skipped(m, src, tgt, tmp_path, keep_e=[1, 3])
    assert (loaded.cfg.residual, loaded.cfg.residual_mixing, loaded.cfg.encoder_layers) == (residual, mixing, 2)
    kept, own = loaded.encoder.layers[0].ffn.hyper.state_dict(), m.encoder.layers[1].ffn.hyper.state_dict()
    assert all(torch.equal(kept[k], own[k]) for k in own)  # layer 1's mixing weights, now at index 0


@pytest.mark.parametrize("residual, mixing", VARIANTS)
def test_under_mixed_precision_the_streams_stay_fp32(residual, mixing):
    m = model(residual, mixing)
    src, _ = batch()
    h = m.encoder.stream_in(m.encoder.embed(src))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m.encoder.layers[0](h, src.eq(PAD))
        assert out.dtype == torch.float32 and m(*batch()).isfinite().all()
    torch.testing.assert_close(out, m.encoder.layers[0](h, src.eq(PAD)), atol=0.1, rtol=0.05)


def test_subln_takes_hyper_connections_and_add_is_todays_model():
    m = model("hyper", "static", norm={"placement": "subln"})
    assert m(*batch()).isfinite().all()
    torch.manual_seed(0)
    a = Seq2SeqTransformer(tiny())
    torch.manual_seed(0)
    b = Seq2SeqTransformer(tiny(residual="add"))
    assert list(a.state_dict()) == list(b.state_dict()) and a.encoder.stream_out is None
    assert not any("hyper" in k for k in a.state_dict())


REFUSED = [
    (dict(residual="hyper", norm={"placement": "post"}), "model.residual: hyper with norm.placement=post"),
    (dict(residual="mhc", norm={"placement": "sandwich"}), "model.residual: mhc with norm.placement=sandwich"),
    (dict(residual="hyper", layer_aggregation="dlcl"), "model.residual: hyper with model.layer_aggregation=dlcl"),
    (dict(residual_streams=2), "model.residual_streams: 2 with model.residual=add"),
    (dict(residual_mixing="dynamic"), "model.residual_mixing: dynamic with model.residual=add"),
    (dict(residual="dense"), "model.residual: 'dense' is not valid (allowed: add, hyper, mhc)"),
    (dict(residual="hyper", residual_streams=0), "model.residual_streams: 0 is not valid"),
]


@pytest.mark.parametrize("kw, message", REFUSED)
def test_refused_combinations_name_both_keys(kw, message):
    with pytest.raises(ConfigError) as err:
        tiny(**kw)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_one_stream_hyper_connection_is_pre_ln():
    # n = 1: α_m = A_r = β = 1, the plain residual (mHC: H_res = 1, H_post = 1, H_pre = σ(10) ≈ 1)
    torch.manual_seed(0)
    pre = Seq2SeqTransformer(tiny(norm={"placement": "pre", "eps": 1e-12})).eval()
    hc = Seq2SeqTransformer(tiny(residual="hyper", residual_streams=1, norm={"placement": "pre", "eps": 1e-12}))
    hc.load_state_dict(pre.state_dict(), strict=False)
    assert torch.equal(hc.eval()(*batch()), pre(*batch()))
    assert math.isclose(torch.sigmoid(torch.tensor(10.0)).item(), 1.0, abs_tol=1e-4)
