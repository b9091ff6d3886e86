"""Hyper-connections (Zhu et al. 2024) and mHC (Xie et al. 2025), model.residual=hyper|mhc (issue 20):
each block against its formula with hand-set weights and an independent computation here (float64,
stream by stream), Sinkhorn's doubly-stochastic mixing, pre-LN at init, mHC's init and its streams
parting in training, cached == uncached decoding,
LayerDrop passing the streams through, pruning == skipping through save and load, refusals."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normlab.config import ConfigError, ModelConfig
from normlab.model.hyper import DYNAMIC_SCALE, HyperConnection, ManifoldHyperConnection, mhc_init, sinkhorn
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
    b = block(ManifoldHyperConnection(n, d, index=4, dynamic=dynamic, eps=1e-5))
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


@pytest.mark.parametrize("spread", [0.5, 3.0])
def test_sinkhorns_hand_written_backward_is_autograds_through_the_iterations(spread):
    # The same gradient as autograd through the 20 unrolled iterations (sinkhorn_reference), in
    # float64 to rounding, for logits near the identity init and far from it; and gradcheck's
    # finite differences. Keep spread 3.0: near convergence (0.5) a backward that normalises over
    # the wrong axis still agrees to 3e-16; at 3.0 it is off by ~2e-2 (the wrong step order by
    # more). The forward runs in place on its own buffer: the logits are left as they were.
    g = torch.Generator().manual_seed(3)
    logits = (spread * torch.randn(4, 4, 3, 5, generator=g, dtype=torch.float64)).requires_grad_()
    before = logits.detach().clone()
    weights = torch.randn(4, 4, 3, 5, generator=g, dtype=torch.float64)
    ours = sinkhorn(logits)
    assert torch.equal(logits.detach(), before)
    ref = sinkhorn_reference(logits)
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad((ours * weights).sum(), logits)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    assert grad.abs().max() > 1e-3  # a gradient that is there to compare
    torch.testing.assert_close(grad, grad_ref, atol=1e-12, rtol=0)
    torch.autograd.gradcheck(lambda x: sinkhorn(x, 5), (logits[:, :, :1, :2].detach().requires_grad_(),))
    with pytest.raises(ValueError, match="iters=0; must be at least 1"):
        sinkhorn(logits, 0)  # no normalisation: the backward's constant max would be wrong


def test_sinkhorn_gives_doubly_stochastic_matrices_per_token():
    # 20 iterations (mHC's t_max): columns sum to 1 after the last step; rows converge geometrically,
    # to rounding for logits of spread 0.5, to 1e-3 for spread 1 (at spread 2: ~2e-2)
    for spread, rows in ((0.5, 1e-6), (1.0, 1e-3)):
        m = sinkhorn(spread * torch.randn(4, 4, 50, 5, generator=torch.Generator().manual_seed(0)))
        assert (m > 0).all()
        torch.testing.assert_close(m.sum(0), torch.ones(4, 50, 5), atol=1e-6, rtol=0)
        torch.testing.assert_close(m.sum(1), torch.ones(4, 50, 5), atol=rows, rtol=0)
    torch.testing.assert_close(sinkhorn(torch.zeros(4, 4)), torch.full((4, 4), 0.25), atol=0, rtol=0)
    # Near mHC's init (≈ I, off-diagonal logits −8) rows converge slowly (Sinkhorn's rate is set by
    # the off-diagonal mass, ~1e-3 here): 20 iterations leave them off by ~5e-3 for a diagonal
    # moved by N(0, 0.5²), ~2e-2 for N(0, 1); columns are exact whatever the logits.
    _, b_res = mhc_init(4, 0)
    for spread, rows in ((0.5, 1e-2), (1.0, 3e-2)):
        m = sinkhorn(b_res[..., None] + spread * torch.randn(4, 4, 200, generator=torch.Generator().manual_seed(0)))
        torch.testing.assert_close(m.sum(0), torch.ones(4, 200), atol=1e-6, rtol=0)
        err = (m.sum(1) - 1).abs().max().item()
        assert rows / 10 < err < rows, (spread, err)
    # inside a trained-looking mHC model: every block's H_res, every token (weights() gives its
    # transpose, mix[source, target]: each source's mass sums to 1 over the targets)
    m = model("mhc", "dynamic")
    hyper = m.encoder.layers[0].self_attn.hyper
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # randomise_ moves only 1-D parameters: H_res's logits and φ too, as training would
        hyper.b_res.add_(0.5 * torch.randn(hyper.b_res.shape, generator=g))
        hyper.phi.copy_(0.02 * torch.randn(hyper.phi.shape, generator=g))
    src, _ = batch()
    h = m.encoder.stream_in(m.encoder.embed(src))
    _, res, _ = hyper.weights(h)
    assert res.shape == (4, 4, *src.shape) and (res > 0).all()
    torch.testing.assert_close(res.sum(1), torch.ones(4, *src.shape), atol=1e-6, rtol=0)
    torch.testing.assert_close(res.sum(0), torch.ones(4, *src.shape), atol=3e-2, rtol=0)


# ---- initialisation: pre-LN ------------------------------------------------------------------------
@pytest.mark.parametrize("residual, mixing", VARIANTS)
def test_at_init_every_stream_is_pre_lns_stream(residual, mixing):
    # HC: bit for bit (one-hot and identity products are exact). mHC: to rounding (read weights
    # σ(b_pre) summing to 1, H_res ≈ I doubly stochastic: a few ulps of streams of size ~5).
    def same(s, ref):
        if residual == "hyper":
            assert torch.equal(s, ref)
        else:
            torch.testing.assert_close(s, ref, atol=1e-5, rtol=0)

    torch.manual_seed(0)
    pre = Seq2SeqTransformer(tiny()).eval()
    hc = Seq2SeqTransformer(tiny(residual=residual, residual_mixing=mixing)).eval()
    missing, unexpected = hc.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected and all(".hyper." in k for k in missing)
    src, tgt = batch()
    for a, b in ((hc.encoder, pre.encoder),):
        streams = a.aggregation(a.layers, a.stream_in(a.embed(src)), src.eq(PAD))
        one = b.aggregation(b.layers, b.embed(src), src.eq(PAD))
        assert streams.shape == (4, *one.shape) and one.abs().max() > 1
        for s in streams:  # n copies of pre-LN's stream
            same(s, one)
    memory, pad = hc.encode(src)
    streams = hc.decoder.aggregation(hc.decoder.layers, hc.decoder.stream_in(hc.decoder.embed(tgt)), memory, pad, None)
    ref = pre.decoder.aggregation(pre.decoder.layers, pre.decoder.embed(tgt), memory, pad, None)
    for s in streams:
        same(s, ref)
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


def test_mhc_init_is_hc_eq_14_through_mhcs_maps():
    # b_res = 0 on the diagonal, −8 off it (mhc-lite's and tokenbender's mHC init): Sinkhorn gives E,
    # diagonal p = 1/(1 + 3e⁻⁸), elsewhere e⁻⁸·p; σ(b_pre) = E's row k mod n; b_post = 0 (2σ = 1)
    p = 1 / (1 + 3 * math.exp(-8))
    expected = torch.full((4, 4), math.exp(-8) * p).fill_diagonal_(p)
    assert expected.sum(0).sub(1).abs().max() < 1e-7 and p == pytest.approx(0.998995, abs=1e-6)
    m = Seq2SeqTransformer(tiny(residual="mhc", residual_mixing="dynamic", encoder_layers=3, decoder_layers=2))
    for stack, key in ((m.encoder, "enc"), (m.decoder, "dec")):
        blocks = [b.hyper for _, b in stack.residual_blocks(key)]
        assert [c.b_pre.argmax().item() for c in blocks] == [0, 1, 2, 3, 0, 1]  # stream k mod n
        for k, c in enumerate(blocks):
            assert torch.equal(c.b_res, torch.full((4, 4), -8.0).fill_diagonal_(0.0))
            torch.testing.assert_close(sinkhorn(c.b_res), expected, atol=1e-7, rtol=0)
            torch.testing.assert_close(torch.sigmoid(c.b_pre), expected[k % 4], atol=1e-7, rtol=0)
            assert torch.equal(c.b_post, torch.zeros(4)) and torch.equal(c.phi, torch.zeros_like(c.phi))
            assert torch.equal(c.scale, torch.full((3,), DYNAMIC_SCALE))
    for n in (2, 3, 8):  # the read weights sum to 1 for every n; n = 1 reads its stream with σ(10)
        b_pre, b_res = mhc_init(n, 5)
        assert torch.sigmoid(b_pre.double()).sum().item() == pytest.approx(1, abs=1e-7)
        assert b_pre.argmax() == 5 % n and sinkhorn(b_res).diagonal().min() > 0.99
    assert mhc_init(1, 3)[0].tolist() == [10.0] and mhc_init(1, 3)[1].tolist() == [[0.0]]


def stream_spread(residual, mixing, init=None, steps=30):
    """A 2+2 pre-LN model trained `steps` Adam steps (lr 1e-3): the n streams after its 2 encoder
    layers, their relative RMS distance from their mean, ‖H − H̄‖ / (√n·‖H̄‖); `init(connection)`
    resets every block's mixing weights before training."""
    torch.manual_seed(0)
    m = Seq2SeqTransformer(tiny(residual=residual, residual_mixing=mixing, encoder_layers=2, decoder_layers=2))
    if init is not None:
        for _, b in m.residual_blocks():
            init(b.hyper)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    for step in range(steps):
        src, tgt = batch(step)
        loss = F.cross_entropy(m(src, tgt[:, :-1]).reshape(-1, V), tgt[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    src, _ = batch(99)
    m.eval()
    with torch.no_grad():
        h = m.encoder.stream_in(m.encoder.embed(src))
        for layer in m.encoder.layers:
            h = layer(h, src.eq(PAD))
    mean = h.mean(0)
    return ((h - mean).norm() / (mean.norm() * h.shape[0] ** 0.5)).item()


@torch.no_grad()
def uniform_init_(c):  # the init this replaced: σ(b_pre) = 1/n, Sinkhorn(b_res) = 1/n everywhere
    c.b_pre.fill_(-math.log(c.n - 1))
    c.b_res.zero_()


@pytest.mark.parametrize("mixing", ["static", "dynamic"])
def test_mhc_streams_part_in_training(mixing):
    # Measured (30 steps): mHC 1.2e-3 static, 1.3e-3 dynamic; HC 2.7e-2 and 2.9e-2. The permutation-
    # symmetric init (every stream read and mixed alike) gives every stream the same gradient, so
    # the n equal copies of the embedding stay equal, to the bit: one stream's model n times over.
    assert stream_spread("mhc", mixing) > 5e-4
    assert stream_spread("mhc", mixing, init=uniform_init_) == 0.0
    assert stream_spread("hyper", mixing) > 5e-3


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
