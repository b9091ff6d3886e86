"""Attention options of issue 20 (item 2), each against its formula with hand-set weights and an
independent computation here, its limit cases, its initialisation, and cached == uncached decoding:
QK-norm (Henry et al. 2020; model.qk_norm=l2|rms)."""
import math

import pytest
import torch

from normlab.config import ModelConfig
from normlab.decoding.beam import beam_search
from normlab.decoding.greedy import greedy_decode
from normlab.model.attention import L2QKNorm, MultiheadAttention, RMSQKNorm, build_qk_norm
from normlab.model.transformer import Seq2SeqTransformer

from test_decoding import naive_greedy

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


def reference(attn, x, memory=None, pad=None, causal=False, qk="none"):
    # softmax(logits) V, written out: logits = q·k/√Dh (none), g·q̂·k̂ (l2), RMS(q)·RMS(k)/√Dh (rms).
    x, kv = x.double(), (x if memory is None else memory).double()
    lin = lambda m, t: t @ m.weight.double().T + m.bias.double()  # noqa: E731
    H = attn.num_heads
    q, k, v = heads(lin(attn.q_proj, x), H), heads(lin(attn.k_proj, kv), H), heads(lin(attn.v_proj, kv), H)
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
    off = Seq2SeqTransformer(tiny(qk_norm="none", qk_norm_scale_init=4.0))  # g₀ acts only with l2
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
    model = feature_model(name)
    src = source(B=6, seed=2)
    tgt = torch.randint(3, V, (6, 6), generator=torch.Generator().manual_seed(3))
    memory, pad = model.encode(src)
    full = model.decode(tgt, memory, pad)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t: t + 1], memory, pad, cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert greedy_decode(model, src, max_len_a=1.0, max_len_b=3) == naive_greedy(model, src, 1.0, 3, 0)
    cached = beam_search(model, src, beam=3, lenpen=0.6, max_len_a=1.0, max_len_b=3)
    uncached = beam_search(model, src, beam=3, lenpen=0.6, max_len_a=1.0, max_len_b=3, incremental=False)
    assert [[h["tokens"] for h in nb] for nb in cached] == [[h["tokens"] for h in nb] for nb in uncached]
    torch.testing.assert_close(torch.tensor([[h["score"] for h in nb] for nb in cached]),
                               torch.tensor([[h["score"] for h in nb] for nb in uncached]), atol=1e-5, rtol=1e-5)
