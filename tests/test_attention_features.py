"""Attention options of issue 20 (item 2), each against its formula with hand-set weights and an
independent computation here, its limit cases, its initialisation, and cached == uncached decoding:
QK-norm (Henry et al. 2020; model.qk_norm=l2|rms) and the value residual (Zhou et al. 2024;
model.value_residual=true), with LayerDrop and pruning."""
import math

import pytest
import torch

from normlab.config import ModelConfig
from normlab.decoding.beam import beam_search
from normlab.decoding.greedy import greedy_decode
from normlab.checkpoint import load_model, save_model
from normlab.model.attention import FirstValues, MultiheadAttention, ValueResidual
from normlab.model.qk_norms import L2QKNorm, RMSQKNorm, build_qk_norm
from normlab.model.transformer import Seq2SeqTransformer
from normlab.regularizers.pruning import prune

from test_decoding import naive_greedy
from test_pruning import Identity

V, PAD = 13, 0


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=8, encoder_layers=3, decoder_layers=3, encoder_heads=2, decoder_heads=2,
                encoder_ffn=12, decoder_ffn=12, max_positions=32)
    return ModelConfig(**{**base, **kw})


def source(B=4, S=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (B, S), generator=g)
    src[1, 4:] = PAD
    return src


def hand_set_(attn: MultiheadAttention, seed: int = 0) -> MultiheadAttention:
    # Fixed weights and biases (not the init), norm gains away from 1, g away from its init.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) * 2 - 1 if name.endswith(("weight", "bias")) and "qk_norm" not in name
                    else torch.rand(p.shape, generator=g) + 0.5)
    return attn


def close(actual, expected):  # float32 module against the float64 reference
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def heads(t: torch.Tensor, H: int) -> torch.Tensor:
    B, T, D = t.shape
    return t.reshape(B, T, H, D // H).permute(0, 2, 1, 3)  # (B, H, T, Dh)


def reference(attn, x, memory=None, pad=None, causal=False, qk="none", v1=None):
    # softmax(logits) V, written out: logits = q·k/√Dh (none), g·q̂·k̂ (l2), RMS(q)·RMS(k)/√Dh (rms);
    # with v1 (value residual), V = λ₁·V₁ + λ₂·V.
    x, kv = x.double(), (x if memory is None else memory).double()
    lin = lambda m, t: t @ m.weight.double().T + m.bias.double()  # noqa: E731
    H = attn.num_heads
    q, k, v = heads(lin(attn.q_proj, x), H), heads(lin(attn.k_proj, kv), H), heads(lin(attn.v_proj, kv), H)
    if v1 is not None:
        lam1, lam2 = attn.value_residual.lambdas.double()
        v = lam1 * v1.double() + lam2 * v
    Dh = q.size(-1)
    if qk == "l2":
        g = attn.qk_norm.g.double()
        logits = g * (q / q.pow(2).sum(-1, keepdim=True).sqrt()) @ (k / k.pow(2).sum(-1, keepdim=True).sqrt()).transpose(-1, -2)
    else:
        if qk == "rms":
            eps, wq, wk = attn.qk_norm.q_norm.eps, attn.qk_norm.q_norm.weight.double(), attn.qk_norm.k_norm.weight.double()
            q = q / (q.pow(2).mean(-1, keepdim=True) + eps).sqrt() * wq
            k = k / (k.pow(2).mean(-1, keepdim=True) + eps).sqrt() * wk
        logits = q @ k.transpose(-1, -2) / math.sqrt(Dh)
    if pad is not None:
        logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
    if causal:
        T = x.size(1)
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = (logits.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(x.shape)
    return lin(attn.out_proj, out).float()


# ---- QK-norm ------------------------------------------------------------------------------------
def qk_attention(qk, d=8, H=2, kdim=None, seed=0):
    norm = build_qk_norm(qk, d // H, scale_init=3.0, eps=1e-5)
    return hand_set_(MultiheadAttention(d, H, kdim=kdim, vdim=kdim, kind="cross" if kdim else "encoder_self",
                                        qk_norm=norm), seed).eval()


@pytest.mark.parametrize("qk", ["none", "l2", "rms"])
def test_qk_norm_self_and_cross_attention_match_the_formula(qk):
    g = torch.Generator().manual_seed(5)
    x, memory = torch.randn(2, 5, 8, generator=g) * 3, torch.randn(2, 4, 6, generator=g) * 3
    pad = torch.tensor([[False] * 4, [False, False, True, True]])
    attn = qk_attention(qk)
    close(attn(x), reference(attn, x, qk=qk))
    close(attn(x, causal=True), reference(attn, x, causal=True, qk=qk))
    cross = qk_attention(qk, kdim=6, seed=1)
    close(cross(x, memory, key_padding_mask=pad), reference(cross, x, memory, pad, qk=qk))


def test_l2_qk_norm_logits_are_g_times_the_cosine():
    # One query, two keys: one parallel to it, one opposite. Logits g·cos = g and -g, whatever the
    # lengths of q and k: attention weights softmax([g, -g]).
    norm = L2QKNorm(2.5)
    q = torch.tensor([[[[3.0, 4.0]]]])  # (1, 1, 1, 2), ‖q‖ = 5
    k = torch.tensor([[[[0.6, 0.8], [-6.0, -8.0]]]])
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    out = torch.nn.functional.scaled_dot_product_attention(norm.query(q), norm.key(k), v, scale=norm.sdpa_scale)
    w = torch.softmax(torch.tensor([2.5, -2.5]), 0)
    torch.testing.assert_close(out[0, 0, 0], w)


def test_qk_norm_none_is_todays_attention_bit_for_bit():
    torch.manual_seed(0)
    today = Seq2SeqTransformer(tiny())
    torch.manual_seed(0)
    off = Seq2SeqTransformer(tiny(qk_norm="none"))  # the key present at its default (a scale without l2 is refused)
    assert list(off.state_dict()) == list(today.state_dict())
    src = source()
    assert torch.equal(off(src, src), today(src, src))


def test_qk_norm_in_every_attention_with_the_papers_init():
    model = Seq2SeqTransformer(tiny(qk_norm="l2"))
    attns = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    assert len(attns) == 3 + 2 * 3 and all(isinstance(a.qk_norm, L2QKNorm) for a in attns)
    g0 = math.log2(32 * 32 - 32)  # Henry et al.: log₂(L² − L), here L = max_positions
    assert all(a.qk_norm.g.item() == pytest.approx(g0) for a in attns)
    assert Seq2SeqTransformer(tiny(qk_norm="l2", qk_norm_scale_init=7.5)).encoder.layers[0].self_attn.sublayer.qk_norm.g.item() == 7.5
    rms = Seq2SeqTransformer(tiny(qk_norm="rms", decoder_d_model=12, decoder_heads=3, share_embeddings=False))
    cross = rms.decoder.layers[1].cross_attn.sublayer.qk_norm
    assert isinstance(cross, RMSQKNorm) and torch.equal(cross.k_norm.weight, torch.ones(4))  # Dh = 12 / 3
    assert torch.equal(rms.encoder.layers[0].self_attn.sublayer.qk_norm.q_norm.weight, torch.ones(4))  # 8 / 2
    # the new parameters train
    src = source()
    rms(src, src).logsumexp(-1).sum().backward()
    assert cross.q_norm.weight.grad.abs().sum() > 0 and cross.k_norm.weight.grad.abs().sum() > 0


FEATURES = {
    "qk_l2": dict(qk_norm="l2", qk_norm_scale_init=2.0),
    "qk_rms": dict(qk_norm="rms"),
    "qk_l2_pre_wide_decoder": dict(qk_norm="l2", norm={"placement": "pre"}, decoder_d_model=12, decoder_heads=3,
                                   share_embeddings=False),
}


def feature_model(name, seed=1):
    torch.manual_seed(seed)
    return Seq2SeqTransformer(tiny(**FEATURES[name])).eval()


@pytest.mark.parametrize("name", FEATURES)
def test_cached_decoding_equals_uncached(name):
    src = source(B=6, seed=2)
    check_cached_decoding(feature_model(name), src, torch.randint(3, V, (6, 6), generator=torch.Generator().manual_seed(3)))


def check_cached_decoding(model, src, tgt):
    # Step-by-step decoding with the cache is the full forward; greedy and beam search alike.
    memory, pad = model.encode(src)
    full = model.decode(tgt, memory, pad)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t: t + 1], memory, pad, cache) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert greedy_decode(model, src, max_len_a=1.0, max_len_b=3) == naive_greedy(model, src, 1.0, 3, 0)
    cached = beam_search(model, src, beam=3, lenpen=0.6, max_len_a=1.0, max_len_b=3)
    uncached = beam_search(model, src, beam=3, lenpen=0.6, max_len_a=1.0, max_len_b=3, incremental=False)
    assert [[h["tokens"] for h in nb] for nb in cached] == [[h["tokens"] for h in nb] for nb in uncached]
    torch.testing.assert_close(torch.tensor([[h["score"] for h in nb] for nb in cached]),
                               torch.tensor([[h["score"] for h in nb] for nb in uncached]), atol=1e-5, rtol=1e-5)


# ---- value residual -----------------------------------------------------------------------------
def test_value_residual_formula_in_one_attention():
    g = torch.Generator().manual_seed(4)
    attn = hand_set_(MultiheadAttention(8, 2, kind="decoder_self", value_residual=ValueResidual()), 2).eval()
    with torch.no_grad():
        attn.value_residual.lambdas.copy_(torch.tensor([0.3, 1.7]))
    x, v1 = torch.randn(2, 5, 8, generator=g), torch.randn(2, 2, 5, 4, generator=g)
    first = FirstValues()
    first.v = v1
    close(attn(x, causal=True, values=first), reference(attn, x, causal=True, v1=v1))
    assert first.v is v1  # a later layer reads V₁, never replaces it
    # the first self-attention to run: its own values become V₁ and are used unmixed
    first = FirstValues()
    close(attn(x, causal=True, values=first), reference(attn, x, causal=True))
    torch.testing.assert_close(first.v, heads(attn.v_proj(x), 2))
    with pytest.raises(ValueError, match="FirstValues"):
        attn(x)
    with pytest.raises(ValueError, match="self-attention"):
        MultiheadAttention(8, 2, kind="cross", value_residual=ValueResidual())


def sdpa_values(monkeypatch):
    # The values every attention hands to SDPA, in call order.
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, *args, **kwargs):
        seen.append(v)
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)
    return seen


def test_value_residual_mixes_each_stacks_own_first_layer_values(monkeypatch):
    torch.manual_seed(0)
    model = Seq2SeqTransformer(tiny(value_residual=True, decoder_d_model=12, decoder_heads=3,
                                    share_embeddings=False)).eval()
    lambdas = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(n for n in model.named_parameters() if n[0].endswith("lambdas")):
            p.copy_(torch.tensor([0.1 * (i + 1), 1.0 - 0.05 * i]))
            lambdas[name] = p.detach().clone()
    assert len(lambdas) == 3 + 3  # the self-attention of every layer; none in cross-attention
    src, tgt = source(), source(seed=1)[:, :5]
    proj = {}  # the projected values of each self-attention, (B, H, T, Dh)
    for stack in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(model, stack).layers):
            attn = layer.self_attn.sublayer
            attn.register_forward_pre_hook(  # self-attention projects q, k, v in one fused matmul: recompute v
                lambda m, args, key=(stack, i): proj.__setitem__(key, heads(m.v_proj(args[0]), m.num_heads)))
    seen = sdpa_values(monkeypatch)
    with torch.no_grad():
        model(src, tgt)
    enc, dec = seen[:3], seen[3::2]  # encoder self x3, then decoder (self, cross) x3
    for stack, got in (("encoder", enc), ("decoder", dec)):
        torch.testing.assert_close(got[0], proj[(stack, 0)])  # layer 1: its own values, unmixed
        for n in (1, 2):
            lam = lambdas[f"{stack}.layers.{n}.self_attn.sublayer.value_residual.lambdas"]
            torch.testing.assert_close(got[n], lam[0] * proj[(stack, 0)] + lam[1] * proj[(stack, n)])


def test_value_residual_at_lambda_0_1_is_no_value_residual_bit_for_bit():
    torch.manual_seed(0)
    plain = Seq2SeqTransformer(tiny(norm={"placement": "pre"})).eval()
    vr = Seq2SeqTransformer(tiny(norm={"placement": "pre"}, value_residual=True)).eval()
    missing, unexpected = vr.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(k.endswith("value_residual.lambdas") for k in missing)
    with torch.no_grad():
        for k in missing:
            vr.get_parameter(k).copy_(torch.tensor([0.0, 1.0]))
    src, tgt = source(), source(seed=1)[:, :5]
    assert torch.equal(vr(src, tgt), plain(src, tgt))
    with torch.no_grad():
        for k in missing:
            vr.get_parameter(k).copy_(torch.tensor([0.5, 0.5]))  # the init: now it differs
    assert not torch.allclose(vr(src, tgt), plain(src, tgt))
    assert all(torch.equal(m.lambdas, torch.tensor([0.5, 0.5]))
               for m in Seq2SeqTransformer(tiny(value_residual=True)).modules() if isinstance(m, ValueResidual))


FEATURES.update({
    "value_residual": dict(value_residual=True),
    "value_residual_qk_rms_deepnorm": dict(value_residual=True, qk_norm="rms", norm={"placement": "deepnorm"}),
    "value_residual_dlcl": dict(value_residual=True, layer_aggregation="dlcl", norm={"placement": "pre"}),
    "value_residual_resi_dual": dict(value_residual=True, norm={"placement": "resi_dual"}),
    # the placements of 2023-2025 pass the first layer's values through to self-attention too
    "value_residual_b2t": dict(value_residual=True, qk_norm="rms", norm={"placement": "b2t"}),
    "value_residual_mix": dict(value_residual=True, norm={"placement": "mix", "mix_ratio": 0.5}),
    "value_residual_pre_scaled": dict(value_residual=True, norm={"placement": "pre_scaled"}),
    "value_residual_hybrid": dict(value_residual=True, norm={"placement": "hybrid", "type": "rmsnorm"}),
})


def randomise_lambdas_(model):
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lambdas"):
                p.copy_(torch.rand(2, generator=g) + 0.25)
    return model


@pytest.mark.parametrize("dropped", [[0], [0, 2]])
def test_value_residual_pruned_equals_skipped_and_survives_save_load(dropped, tmp_path):
    # Layer 1 pruned (or skipped): the first layer that runs gives V₁ and uses its values unmixed, as
    # in a model built without layer 1; the pruned checkpoint rebuilds from its config.
    torch.manual_seed(0)
    model = randomise_lambdas_(Seq2SeqTransformer(tiny(value_residual=True))).eval()
    keep = [i for i in range(3) if i not in dropped]
    pruned = prune(model, keep, keep)
    ref = Seq2SeqTransformer(tiny(value_residual=True)).eval()
    ref.load_state_dict(model.state_dict())
    for stack in (ref.encoder, ref.decoder):
        for i in dropped:
            stack.layers[i] = Identity()
    src, tgt = source(), source(seed=1)[:, :5]
    assert torch.equal(pruned(src, tgt), ref(src, tgt))
    assert not torch.allclose(pruned(src, tgt), model(src, tgt))
    loaded, _ = load_model(save_model(tmp_path / "pruned.ckpt", pruned, tokenizer_proto=None))
    assert loaded.cfg.value_residual and loaded.cfg.encoder_layers == len(keep)
    assert torch.equal(loaded(src, tgt), pruned(src, tgt))


def test_value_residual_under_layerdrop_with_layer_one_dropped():
    # Training with LayerDrop: when layer 1 is dropped, the forward is the pruned model's (the first
    # layer that runs gives V₁), and every λ, the skipped layer's and the new first layer's included,
    # gets a gradient (zero where unused): DDP without find_unused_parameters stays possible.
    torch.manual_seed(0)
    model = randomise_lambdas_(Seq2SeqTransformer(tiny(value_residual=True, regularizer={
        "encoder_layerdrop": 0.5, "decoder_layerdrop": 0.5})))
    src, tgt = source(), source(seed=1)[:, :5]
    for _ in range(50):
        model.zero_grad()
        out = model.train()(src, tgt)
        kept = model.encoder.layers.last_kept, model.decoder.layers.last_kept
        if 0 not in kept[0] and 0 not in kept[1] and kept[0] and kept[1]:
            break
    else:
        pytest.fail("no draw dropped layer 1 of both stacks")
    out.logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    first = model.encoder.layers[kept[0][0]].self_attn.sublayer.value_residual.lambdas
    assert torch.equal(first.grad, torch.zeros(2))  # the first layer that ran: unmixed
    with torch.no_grad():
        torch.testing.assert_close(out, prune(model, *kept).eval()(src, tgt))


def test_combinations_that_would_mislead_are_refused_in_one_line():
    """Review findings: a value residual under learned LayerDrop rates (a gated-off first layer still
    set V₁, so the trained model differed from the pruned one); a QK-norm scale without l2 QK-norm
    (it does nothing but rename the run); a bad qk_norm is named as itself before any combination."""
    from normlab.config import ConfigError

    with pytest.raises(ConfigError, match=r"^model.value_residual: true with regularizer.layerdrop_rates=learned"):
        tiny(value_residual=True, regularizer={"encoder_layerdrop": 0.2, "layerdrop_rates": "learned"})
    tiny(value_residual=True, regularizer={"encoder_layerdrop": 0.2})  # uniform rates: pruned == skipped
    with pytest.raises(ConfigError, match=r"^model.qk_norm_scale_init: 5.0 with model.qk_norm=rms"):
        tiny(qk_norm="rms", qk_norm_scale_init=5.0)
    with pytest.raises(ConfigError, match=r"^model.qk_norm: 'foo' is not valid"):
        tiny(qk_norm="foo", norm={"placement": "hybrid"})
    Seq2SeqTransformer(tiny(max_positions=1))  # log2(L² − L) is computed for l2 QK-norm only
