"""The attention-stability schemes of issue 38 (model/stability.py), each against its formula written out
here in float64 with hand-set weights (not the module's code path), its limit cases (a sink logit of -1e9
is plain attention, a cap of 1e6 is no cap, the gate's init is ½), cached == full decoding, and the
combinations refused in one line: gated attention (Qiu et al. 2025), a learned sink (gpt-oss), attention-
and output-logit soft-capping (Gemma 2), key / value RMSNorm (x-transformers k_rmsnorm, value_rmsnorm).
The output cap in the chunked loss and a 2-step run of each: tests/test_attention_stability_runs.py."""
import math

import pytest
import torch

from normlab.config import ConfigError, ModelConfig
from normlab.model.attention import MultiheadAttention
from normlab.model.stability import PAPERS, AttentionStability
from normlab.model.transformer import Seq2SeqTransformer

from test_attention_features import check_cached_decoding, heads, source, tiny

V = 13
SCHEMES = {  # AttentionStability's arguments of each scheme and of the combinations tested
    "gate_headwise": dict(gate="headwise"),
    "gate_elementwise": dict(gate="elementwise"),
    "sink": dict(sink=True),
    "softcap": dict(logit_cap=2.0),
    "softcap_sink": dict(logit_cap=2.0, sink=True),
    "k_norm": dict(k_norm=True),
    "v_norm": dict(v_norm=True),
    "all": dict(gate="elementwise", sink=True, logit_cap=2.0, k_norm=True, v_norm=True),
}


def attention(d=8, H=2, kdim=None, seed=0, **stability) -> MultiheadAttention:
    # float64, every weight hand-set (gains, gate, sink away from their init)
    attn = MultiheadAttention(d, H, kdim=kdim, vdim=kdim, kind="cross" if kdim else "encoder_self",
                              stability=AttentionStability(H, d // H, d, eps=1e-5, **stability) if stability else None)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            gain = name.endswith("norm.weight")
            p.copy_(torch.rand(p.shape, generator=g, dtype=torch.float64) + 0.5 if gain
                    else (torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1) * (3 if "sink" in name else 1))
    return attn.double().eval()


def rms(t, w, eps=1e-5):
    return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w


def reference(attn, x, memory=None, pad=None, causal=False):
    # The formulas, in float64: q, k, v = x W + b; k ← RMS(k)·w_k, v ← RMS(v)·w_v per head (gains per
    # head); s = q·kᵀ/√Dh, s ← c·tanh(s/c); p = softmax over [s, b_h] without the sink's column;
    # Y = p V; Y ← Y ⊙ σ(x W_θ) per head or channel; out = concat(Y) W_o + b_o.
    st = attn.stability
    kv = x if memory is None else memory
    lin = lambda m, t: t @ m.weight.T + m.bias  # noqa: E731
    H = attn.num_heads
    q, k, v = heads(lin(attn.q_proj, x), H), heads(lin(attn.k_proj, kv), H), heads(lin(attn.v_proj, kv), H)
    if st is not None and st.k_norm is not None:
        k = rms(k, st.k_norm.weight)
    if st is not None and st.v_norm is not None:
        v = rms(v, st.v_norm.weight)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))  # (B, H, T, S)
    if st is not None and st.logit_cap is not None:
        s = st.logit_cap * torch.tanh(s / st.logit_cap)
    if pad is not None:
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    if causal:
        s = s.masked_fill(torch.ones(s.size(-2), s.size(-1), dtype=torch.bool).triu(1), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    denominator = e.sum(-1, keepdim=True)
    if st is not None and st.sink is not None:  # exp(b_h) in the denominator, on the same shift
        denominator = denominator + torch.exp(st.sink.logits.view(1, -1, 1, 1) - s.amax(-1, keepdim=True))
    y = (e / denominator) @ v  # (B, H, T, Dh)
    if st is not None and st.gate is not None:
        gate = torch.sigmoid(x @ st.gate.weight.T)  # (B, T, H) or (B, T, D)
        gate = gate.reshape(*gate.shape[:2], H, -1).permute(0, 2, 1, 3)  # (B, H, T, 1 or Dh)
        y = y * gate
    return lin(attn.out_proj, y.permute(0, 2, 1, 3).reshape(x.shape))


def inputs():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64) * 3
    memory = torch.randn(2, 4, 6, generator=g, dtype=torch.float64) * 3
    return x, memory, torch.tensor([[False] * 4, [False, False, True, True]])


def exact(actual, expected):  # float64 against float64: a formula, not a tolerance for float32
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", SCHEMES)
def test_self_and_cross_attention_match_the_formula(name):
    x, memory, pad = inputs()
    attn = attention(**SCHEMES[name])
    exact(attn(x), reference(attn, x))
    exact(attn(x, causal=True), reference(attn, x, causal=True))
    cross = attention(kdim=6, seed=1, **SCHEMES[name])
    exact(cross(x, memory, key_padding_mask=pad), reference(cross, x, memory, pad))
    # the reference differs from plain attention by more than the tolerance: the scheme acts
    plain = attention(seed=0)
    assert (reference(attn, x) - plain(x)).abs().max() > 1e-3


def test_headwise_gate_is_one_value_per_head_and_position():
    # Y' = Y ⊙ σ(X W_θ) with W_θ: d -> H: each head's Dh channels are scaled by the same gate.
    x, _, _ = inputs()
    attn = attention(gate="headwise")
    seen = {}
    attn.out_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("y", args[0]))
    attn(x)
    plain = attention(seed=0)
    plain.out_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("plain", args[0]))
    plain(x)
    ratio = heads(seen["y"], 2) / heads(seen["plain"], 2)  # (B, H, T, Dh)
    exact(ratio, ratio[..., :1].expand_as(ratio))
    exact(ratio[..., 0], torch.sigmoid(x @ attn.stability.gate.weight.T).transpose(1, 2))


def test_limits_a_sink_of_minus_1e9_and_a_cap_of_1e6_are_plain_attention():
    # exp(-1e9) is 0 in float64: exact. c·tanh(s/c) = s − s³/(3c²) + ...: |s| < 65 here, moved by < 1e-7.
    x, memory, pad = inputs()
    for kw in (dict(sink=True), dict(sink=True, logit_cap=1e6), dict(logit_cap=1e6)):
        same = exact if "logit_cap" not in kw else (
            lambda a, b: torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7))
        attn, plain = attention(**kw), attention(seed=0)
        cross, plain_cross = attention(kdim=6, seed=1, **kw), attention(kdim=6, seed=1)
        with torch.no_grad():
            for module in (attn, cross):
                if module.stability.sink is not None:
                    module.stability.sink.logits.fill_(-1e9)
        for kwargs in ({}, {"causal": True}):
            same(attn(x, **kwargs), plain(x, **kwargs))
        same(cross(x, memory, key_padding_mask=pad), plain_cross(x, memory, key_padding_mask=pad))


def test_a_sink_takes_its_share_and_a_cap_bounds_the_logits():
    # One query, two keys with logits 0 and 0 and a sink of logit log 2: weights 1/4, 1/4 (the sink
    # takes 1/2, its value 0). Logits ±100 capped at 1: weights softmax([tanh 100, -tanh 100]).
    st = AttentionStability(1, 2, 2, sink=True)
    with torch.no_grad():
        st.sink.logits.fill_(math.log(2.0))
    q, k = torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 2, 2)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    torch.testing.assert_close(st.attend(q, k, v)[0, 0, 0], torch.tensor([0.25, 0.25]))
    capped = AttentionStability(1, 2, 2, logit_cap=1.0)
    q, k = torch.tensor([[[[10.0, 0.0]]]]), torch.tensor([[[[10 * math.sqrt(2), 0.0], [-10 * math.sqrt(2), 0.0]]]])
    w = torch.softmax(torch.tensor([math.tanh(100.0), -math.tanh(100.0)]), 0)
    torch.testing.assert_close(capped.attend(q, k, v)[0, 0, 0], w)


def test_the_init_of_each_scheme_and_the_other_weights_seed_for_seed():
    # gate W_θ = 0 (σ = ½, x-transformers' gate_values), sink logits 0, key / value gains 1; no draw
    # from the global generator, so every other weight is the plain model's with the same seed.
    torch.manual_seed(0)
    plain = Seq2SeqTransformer(tiny())
    torch.manual_seed(0)
    model = Seq2SeqTransformer(tiny(attn_gate="elementwise", attn_sink=True, k_norm=True, v_norm=True))
    state, plain_state = model.state_dict(), plain.state_dict()
    new = set(state) - set(plain_state)
    assert not set(plain_state) - set(state)
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)
    assert len(new) == 4 * (3 + 2 * 3)  # gate, sink, k and v gains in every attention, self and cross
    for key in new:
        expected = 1.0 if key.endswith("norm.weight") else 0.0
        assert torch.equal(state[key], torch.full_like(state[key], expected)), key
    st = model.decoder.layers[0].cross_attn.sublayer.stability
    assert st.gate.weight.shape == (8, 8) and st.sink.logits.shape == (2,) and st.v_norm.weight.shape == (2, 1, 4)
    head = Seq2SeqTransformer(tiny(attn_gate="headwise")).encoder.layers[0].self_attn.sublayer.stability.gate
    assert head.weight.shape == (2, 8)  # one gate per head


def test_every_scheme_off_is_todays_attention_bit_for_bit():
    torch.manual_seed(0)
    today = Seq2SeqTransformer(tiny())
    torch.manual_seed(0)
    off = Seq2SeqTransformer(tiny(attn_gate="none", attn_sink=False, attn_softcap=None, logit_softcap=None,
                                  k_norm=False, v_norm=False))
    assert list(off.state_dict()) == list(today.state_dict())
    assert all(m.stability is None for m in off.modules() if isinstance(m, MultiheadAttention))
    src = source()
    assert torch.equal(off(src, src), today(src, src))


MODELS = {  # each scheme in a whole model, and with the schemes it composes with
    "gate_headwise": dict(attn_gate="headwise"),
    "gate_elementwise": dict(attn_gate="elementwise"),
    "sink": dict(attn_sink=True),
    "attn_softcap": dict(attn_softcap=1.5),
    "logit_softcap": dict(logit_softcap=2.0),
    "k_norm": dict(k_norm=True),
    "v_norm": dict(v_norm=True),
    "all_pre_wide_decoder": dict(attn_gate="headwise", attn_sink=True, attn_softcap=1.5, logit_softcap=2.0,
                                 k_norm=True, v_norm=True, norm={"placement": "pre"}, decoder_d_model=12,
                                 decoder_heads=3, share_embeddings=False),
    "qk_l2_v_norm_value_residual_sink": dict(qk_norm="l2", qk_norm_scale_init=2.0, v_norm=True, value_residual=True,
                                             attn_sink=True),
    "hybrid_gate_softcap_sink": dict(attn_gate="elementwise", attn_softcap=1.5, attn_sink=True,
                                     norm={"placement": "hybrid", "type": "rmsnorm"}),
    "deepnorm_k_norm_gate": dict(k_norm=True, attn_gate="headwise", norm={"placement": "deepnorm"}),
    "hyper_sink_logit_softcap": dict(residual="hyper", norm={"placement": "pre"}, attn_sink=True, logit_softcap=2.0,
                                     v_norm=True),
}


def stability_model(name, seed=1):
    # trained-looking values: gates, sinks and gains away from their init
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(tiny(**MODELS[name])).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if ".stability." in key:
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1 + (1.0 if key.endswith("norm.weight") else 0.0))
    return model


@pytest.mark.parametrize("name", MODELS)
def test_cached_decoding_equals_full_decoding(name):
    src = source(B=6, seed=2)
    tgt = torch.randint(3, V, (6, 6), generator=torch.Generator().manual_seed(3))
    check_cached_decoding(stability_model(name), src, tgt)


def test_output_softcap_caps_the_decoding_logits():
    plain = stability_model("sink")
    capped = Seq2SeqTransformer(tiny(attn_sink=True, logit_softcap=0.5)).eval()
    capped.load_state_dict(plain.state_dict())
    src = source()
    logits = plain(src, src)
    assert logits.abs().max() > 1.0  # the cap acts
    torch.testing.assert_close(capped(src, src), 0.5 * torch.tanh(logits / 0.5))
    huge = Seq2SeqTransformer(tiny(attn_sink=True, logit_softcap=1e6)).eval()
    huge.load_state_dict(plain.state_dict())
    torch.testing.assert_close(huge(src, src), logits)


def test_the_new_parameters_train_and_fall_in_their_optimizer_groups():
    from normlab.optimizers import parameter_groups

    model = Seq2SeqTransformer(tiny(attn_gate="headwise", attn_sink=True, attn_softcap=1.5, k_norm=True, v_norm=True))
    src = source()
    model(src, src).logsumexp(-1).sum().backward()
    stab = {k: p for k, p in model.named_parameters() if ".stability." in k}
    assert stab and all(p.grad is not None and p.grad.abs().sum() > 0 for p in stab.values())
    groups = {k: g for g, members in parameter_groups(model).items() for k, _ in members}
    assert {groups[k] for k in stab if k.endswith("norm.weight")} == {"gains"}
    assert {groups[k] for k in stab if not k.endswith("norm.weight")} == {"scheme"}  # like hyper-connections' matrices


def test_admin_export_folds_omega_into_the_gate():
    # W_θ reads the sub-layer's input, as q, k, v do: Admin's ω folds into its columns too, exactly.
    from normlab.init.admin import export_post_norm

    from test_admin import _randomise, admin_model, make_batch

    model = admin_model(seed=4, attn_gate="elementwise", k_norm=True)
    _randomise(model)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("gate.weight"):
                p.uniform_(-1, 1)
    model.eval()
    plain, report = export_post_norm(model)
    assert report["exact"]
    b = make_batch(3, 7, 6, seed=5)
    torch.testing.assert_close(plain.eval()(b["src"], b["tgt_in"]), model(b["src"], b["tgt_in"]), rtol=1e-4, atol=1e-4)


def test_a_checkpoint_saved_before_the_schemes_loads(tmp_path):
    # A ModelConfig from before the keys existed rebuilds today's model; its weights load strictly.
    from normlab.checkpoint import load_model, save_model

    model = stability_model("sink")
    plain = Seq2SeqTransformer(tiny()).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if ".stability." not in k})
    path = save_model(tmp_path / "old.ckpt", plain, tokenizer_proto=None)
    ckpt = torch.load(path, weights_only=False)
    for key in ("attn_gate", "attn_sink", "attn_softcap", "logit_softcap", "k_norm", "v_norm"):
        del ckpt["model_config"][key]
    torch.save(ckpt, path)
    loaded, _ = load_model(path)
    assert (loaded.cfg.attn_gate, loaded.cfg.attn_sink, loaded.cfg.logit_softcap) == ("none", False, None)
    src = source()
    assert torch.equal(loaded(src, src), plain(src, src))


@pytest.mark.parametrize("kw, line", [
    (dict(attn_gate="channel"), "model.attn_gate: 'channel' is not valid (allowed: none, headwise, elementwise)"),
    (dict(attn_gate=True), "model.attn_gate: True is not valid"),
    (dict(attn_sink="yes"), "model.attn_sink: 'yes' is not valid (allowed: true, false)"),
    (dict(attn_softcap=0), "model.attn_softcap: 0 is not valid (allowed: a number > 0"),
    (dict(logit_softcap=-30.0), "model.logit_softcap: -30.0 is not valid (allowed: a number > 0"),
    (dict(attn_softcap=float("inf")), "model.attn_softcap: inf is not valid (allowed: a number > 0"),  # nan'd all
    (dict(logit_softcap="30"), "model.logit_softcap: '30' is not valid"),
    (dict(k_norm=1), "model.k_norm: 1 is not valid (allowed: true, false)"),
    (dict(k_norm=True, qk_norm="rms"), "model.k_norm: true with model.qk_norm=rms: QK-norm already normalises"),
    (dict(k_norm=True, norm={"placement": "hybrid"}), "model.k_norm: true with norm.placement=hybrid: HybridNorm"),
    (dict(v_norm=True, norm={"placement": "hybrid_star"}), "model.v_norm: true with norm.placement=hybrid_star"),
    (dict(v_norm=True, norm={"placement": "deepnorm"}), "model.v_norm: true with norm.placement=deepnorm: DeepNet "),
])
def test_bad_values_and_combinations_are_refused_in_one_line(kw, line):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**dict(vocab_size=V), **kw})
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_every_scheme_is_in_the_docs_table_with_its_paper():
    from conftest import ROOT

    rows = [line for line in (ROOT / "docs" / "schemes.md").read_text(encoding="utf-8").split("\n") if line.startswith("| `")]
    for key, paper in PAPERS.items():
        mine = [row for row in rows if row.startswith(f"| `{key}=")]
        assert mine and all(paper in row for row in mine), (key, paper)
    assert set(PAPERS) == {f"model.{k}" for k in ("attn_gate", "attn_sink", "attn_softcap", "logit_softcap",
                                                   "k_norm", "v_norm")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_runs_the_sink_mask_and_the_capped_softmax(dtype):
    # Under autocast q, k, v are half precision: the sink's float mask takes q's dtype (SDPA refuses
    # another), the capped logits and their softmax are computed in float32 and rounded once.
    model = stability_model("all_pre_wide_decoder")
    src = source()
    full = model(src, src)
    with torch.autocast("cpu", dtype=dtype):
        half = model(src, src)
    assert half.dtype == dtype
    torch.testing.assert_close(half.float(), full, atol=0.05, rtol=0.05)


def test_capped_logits_and_attnres_depth_logits_stay_fp32_under_bf16_autocast():
    """Autocast casts a matmul to bf16 even on fp32 operands: the capped path's logits (which SDPA's kernels
    keep in fp32) and AttnRes's depth logits were 0.085 off against fp64 that way (review)."""
    from normlab.model.aggregation import AttnRes
    from normlab.model.stability import attention_weights

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 5, 16, generator=g) * 3 for _ in range(2))
    exact = (q.double() @ k.double().transpose(-2, -1)) / 4.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s, _ = attention_weights(q, k, None, False, None, cap=50.0)
    assert s.dtype == torch.float32 and (s.double() - exact).abs().max() < 1e-4
    agg = AttnRes(3, 16)
    with torch.no_grad():
        agg.query.normal_(generator=g)
    sources = [torch.randn(2, 5, 16, generator=g) for _ in range(3)]
    want = agg.attend(2, [x.double() for x in sources])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = agg.attend(2, sources)
    assert (got.double() - want).abs().max() < 1e-5
