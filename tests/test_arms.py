"""The residual and normalization schemes: each forward against its formula with hand-set weights,
each initialisation against its paper's constants, impossible combinations refused by key."""
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from normlab.config import ConfigError, ModelConfig, NormConfig
from normlab.model.attention import MultiheadAttention
from normlab.model.schemes import deepnorm_constants, subln_gains
from normlab.model.norms import Derf, DyT, RMSNorm, build_norm
from normlab.model.residual import ResidualBlock
from normlab.model.transformer import FeedForward, Seq2SeqTransformer

V, PAD = 23, 0


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=16, encoder_layers=3, decoder_layers=2, encoder_heads=2, decoder_heads=2,
                encoder_ffn=24, decoder_ffn=20, max_positions=64)
    return ModelConfig(**{**base, **kw})


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(3, V, (3, 7), generator=g), torch.randint(3, V, (3, 5), generator=g)
    src[0, 5:] = PAD
    return src, tgt


def randomise_(module: nn.Module, seed=1):
    # Norm affine parameters, ReZero's a and DLCL's weights away from their init values, so that a
    # formula that ignored one of them would show.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() <= 1 or name.endswith("aggregation.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return module


def norm(seed) -> nn.Module:
    return randomise_(RMSNorm(8), seed)


# ---- forwards against their formulas ------------------------------------------------------------
def test_placement_formulas():
    torch.manual_seed(0)
    f, n, n_out = nn.Linear(8, 8), norm(1), norm(2)
    x = torch.randn(2, 3, 8)
    deep = ResidualBlock(f, n, 8, "deepnorm", 0.0, alpha=2.5)
    torch.testing.assert_close(deep(x), n(2.5 * x + f(x)))
    torch.testing.assert_close(ResidualBlock(f, n, 8, "subln", 0.0)(x), x + f(n(x)))
    torch.testing.assert_close(ResidualBlock(f, n, 8, "sandwich", 0.0, norm_out=n_out)(x), x + n_out(f(n(x))))
    rezero = ResidualBlock(f, nn.Identity(), 8, "rezero", 0.0)
    torch.testing.assert_close(rezero(x), x)  # a = 0 at init: the identity
    rezero.scale.data.fill_(0.7)
    torch.testing.assert_close(rezero(x), x + 0.7 * f(x))
    d = torch.randn(2, 3, 8)
    y = ResidualBlock(f, n, 8, "resi_dual", 0.0)(torch.stack((x, d)))
    torch.testing.assert_close(y[0], n(x + f(x)))
    torch.testing.assert_close(y[1], d + f(x))


def test_dyt_formula():
    dyt = randomise_(DyT(5, alpha_init=0.5))
    assert DyT(5).alpha.item() == 0.5 and torch.equal(DyT(5).weight, torch.ones(5))
    x = torch.randn(2, 4, 5) * 3
    torch.testing.assert_close(dyt(x), dyt.weight * torch.tanh(dyt.alpha * x) + dyt.bias)
    assert build_norm(NormConfig(type="dyt", placement="pre", dyt_alpha_init=0.8), 5).alpha.item() == pytest.approx(0.8)


def test_derf_formula_against_a_hand_computed_erf():
    # Chen et al. 2025: γ ⊙ erf(α·x + s) + β; init α = 0.5, s = 0, γ = 1, β = 0.
    fresh = build_norm(NormConfig(type="derf", placement="pre"), 3)
    assert isinstance(fresh, Derf) and (fresh.alpha.item(), fresh.shift.item()) == (0.5, 0.0)
    assert torch.equal(fresh.weight, torch.ones(3)) and torch.equal(fresh.bias, torch.zeros(3))
    derf = Derf(3)
    with torch.no_grad():
        derf.alpha.fill_(0.75), derf.shift.fill_(-0.25)
        derf.weight.copy_(torch.tensor([1.5, -2.0, 0.5])), derf.bias.copy_(torch.tensor([0.1, 0.0, -0.3]))
    x = [[-2.0, 0.0, 1.0], [0.5, 3.0, -0.125]]
    expected = [[g * math.erf(0.75 * v - 0.25) + b for v, g, b in zip(row, (1.5, -2.0, 0.5), (0.1, 0.0, -0.3))]
                for row in x]
    torch.testing.assert_close(derf(torch.tensor(x)), torch.tensor(expected))
    assert torch.equal(Derf(3)(torch.zeros(2, 3)), torch.zeros(2, 3))  # erf(0) = 0: zero-centred at init
    derf(torch.tensor(x)).sum().backward()  # α, s, γ, β all learned
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in derf.parameters())


def test_subln_inner_norms_sit_before_the_last_linear_maps():
    torch.manual_seed(2)
    inner = randomise_(nn.LayerNorm(8), 3)
    attn = MultiheadAttention(8, 2, inner_norm=inner).eval()
    x = torch.randn(2, 5, 8)
    q, k, v = (lin(x).view(2, 5, 2, 4).transpose(1, 2) for lin in (attn.q_proj, attn.k_proj, attn.v_proj))
    heads = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1) @ v  # (B, H, T, Dh), √Dh = 2
    torch.testing.assert_close(attn(x), attn.out_proj(inner(heads.transpose(1, 2).reshape(2, 5, 8))))
    ffn_norm = randomise_(nn.LayerNorm(12), 4)
    ffn = FeedForward(8, 12, 0.0, inner_norm=ffn_norm)
    torch.testing.assert_close(ffn(x), ffn.fc2(ffn_norm(torch.relu(ffn.fc1(x)))))
    model = Seq2SeqTransformer(tiny(norm={"placement": "subln"}))
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attn.sublayer.inner_norm, nn.LayerNorm)
    assert isinstance(layer.cross_attn.sublayer.inner_norm, nn.Identity)  # torchscale: self-attention only
    assert layer.ffn.sublayer.inner_norm.normalized_shape == (20,)


def _run_stack(stack, src, pad):
    # the encoder's layers one sub-layer at a time, as the formulas write them
    blocks = [(b, {"key_padding_mask": pad}) if name.endswith("self_attn") else (b, {})
              for name, b in stack.residual_blocks("enc")]
    return stack.embed(src), blocks


def test_resi_dual_stack_output_is_x_plus_norm_of_the_dual_stream():
    model = randomise_(Seq2SeqTransformer(tiny(norm={"placement": "resi_dual"}))).eval()
    src, _ = batch()
    pad = src.eq(PAD)
    x, blocks = _run_stack(model.encoder, src, pad)
    d = x  # the dual stream starts as the stack input
    for block, kw in blocks:
        f = block.sublayer(x, **kw)
        x, d = block.norm(x + f), d + f
    expected = x + model.encoder.final_norm.norm(d)
    torch.testing.assert_close(model.encode(src)[0], expected)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_dlcl_stack_is_the_papers_weighted_history(placement):
    model = randomise_(Seq2SeqTransformer(tiny(norm={"placement": placement}, layer_aggregation="dlcl",
                                               layer_aggregation_stacks="encoder"))).eval()
    assert type(model.decoder.aggregation).__name__ == "LayerChain"
    agg, layers = model.encoder.aggregation, model.encoder.layers
    W = agg.weight.detach()
    src, _ = batch()
    pad = src.eq(PAD)
    ys = [model.encoder.embed(src)]  # y_0
    stored = [ys[0]]  # LN_0 = identity
    for l in range(len(layers) + 1):
        mix = sum(W[l, k] * stored[k] for k in range(l + 1))
        x = mix if placement == "pre" or l == 0 else agg.norms[l - 1](mix)
        if l == len(layers):
            break
        ys.append(layers[l](x, pad))
        stored.append(agg.norms[l](ys[-1]) if placement == "pre" else ys[-1])
    expected = model.encoder.final_norm(x)  # pre: the stack's final norm; post: identity
    torch.testing.assert_close(model.encode(src)[0], expected)


def test_dlcl_weights_start_as_the_average():
    W = Seq2SeqTransformer(tiny(layer_aggregation="dlcl")).encoder.aggregation.weight.detach()
    assert W.shape == (4, 4)
    for l in range(4):
        torch.testing.assert_close(W[l, : l + 1], torch.full((l + 1,), 1 / (l + 1)))
        assert W[l, l + 1:].eq(0).all()


# ---- initialisation against the papers' constants -------------------------------------------------
@pytest.mark.parametrize("n,m", [(6, 6), (18, 18), (12, 3)])
def test_deepnorm_and_subln_constants(n, m):
    c = deepnorm_constants(n, m)
    assert c["encoder"] == pytest.approx((0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)))
    assert c["decoder"] == pytest.approx(((3 * m) ** 0.25, (12 * m) ** -0.25))
    g = subln_gains(n, m)
    assert g["encoder"] == pytest.approx(math.sqrt(math.log(3 * m) * math.log(2 * n) / 3))
    assert g["decoder"] == pytest.approx(math.sqrt(math.log(3 * m)))


@pytest.mark.parametrize("placement", ["deepnorm", "subln"])
def test_scheme_init_scales_value_output_and_ffn_weights_of_xavier(placement):
    torch.manual_seed(4)
    plain = Seq2SeqTransformer(tiny(norm={"placement": "pre" if placement == "subln" else "post"}))
    torch.manual_seed(4)
    model = Seq2SeqTransformer(tiny(norm={"placement": placement}))
    n, m = 3, 2
    if placement == "deepnorm":
        gains = {k: beta for k, (_, beta) in deepnorm_constants(n, m).items()}
        assert model.encoder.layers[1].ffn.alpha.item() == pytest.approx(0.81 * (n ** 4 * m) ** (1 / 16))
        assert model.decoder.layers[0].cross_attn.alpha.item() == pytest.approx((3 * m) ** 0.25)
    else:
        gains = subln_gains(n, m)
    for key, stack, ref in (("encoder", model.encoder, plain.encoder), ("decoder", model.decoder, plain.decoder)):
        for (name, block), (_, ref_block) in zip(stack.residual_blocks(key), ref.residual_blocks(key)):
            sub, ref_sub = block.sublayer, ref_block.sublayer
            cross = name.endswith("cross_attn")
            scaled = ("v_proj", "out_proj") if hasattr(sub, "v_proj") else ("fc1", "fc2")
            for lin in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"):
                if not hasattr(sub, lin):
                    continue
                # Sub-LN leaves cross-attention alone (torchscale); DeepNorm scales it with the decoder's β
                gain = gains[key] if lin in scaled and not (cross and placement == "subln") else 1.0
                torch.testing.assert_close(getattr(sub, lin).weight, gain * getattr(ref_sub, lin).weight)


def test_rezero_starts_at_zero_and_dyt_at_half():
    model = Seq2SeqTransformer(tiny(norm={"placement": "rezero", "type": "none"}))
    assert all(b.scale.item() == 0.0 for _, b in model.residual_blocks())
    assert not any(isinstance(m, (nn.LayerNorm, RMSNorm)) for m in model.modules())
    dyt = Seq2SeqTransformer(tiny(norm={"placement": "pre", "type": "dyt"}))
    assert all(m.alpha.item() == 0.5 for m in dyt.modules() if isinstance(m, DyT))
    derf = Seq2SeqTransformer(tiny(norm={"placement": "pre", "type": "derf"}))
    derfs = [m for m in derf.modules() if isinstance(m, Derf)]
    assert len(derfs) == 2 * 3 + 3 * 2 + 2 and all((m.alpha.item(), m.shift.item()) == (0.5, 0.0) for m in derfs)
    assert not any(isinstance(m, (nn.LayerNorm, DyT)) for m in derf.modules())


def test_fixnorm_output_scale_is_the_final_scalenorm_g_and_gets_a_gradient():
    # Pre-norm ScaleNorm + FixNorm: logits = g_final · cos(x, w), as the authors' code; no dead g.
    model = Seq2SeqTransformer(tiny(norm={"placement": "pre", "type": "scalenorm", "fixnorm": True}))
    assert model.output_projection.g is None
    src, tgt = batch()
    with torch.no_grad():
        model.decoder.final_norm.g.fill_(3.0)
    memory, pad = model.encode(src)
    h = model.decoder(tgt, memory, pad)
    w = model.decoder.embed.tokens.weight
    cos = (h @ w.T) / (h.norm(dim=-1, keepdim=True) * w.norm(dim=-1).clamp(min=1e-12))
    torch.testing.assert_close(model(src, tgt), 3.0 * cos)
    model(src, tgt).logsumexp(-1).sum().backward()
    assert model.decoder.final_norm.g.grad.abs().item() > 1e-3
    post = Seq2SeqTransformer(tiny(norm={"placement": "post", "type": "scalenorm", "fixnorm": True}))
    assert post.output_projection.g is not None  # no final ScaleNorm: the output layer owns g
    # a checkpoint from before: output_projection.g was the output scale, the final g had no effect
    old = {k: v for k, v in model.state_dict().items()}
    old["decoder.final_norm.g"] = torch.tensor(7.0)
    old["output_projection.g"] = torch.tensor(3.0)
    model.load_state_dict(old)
    assert model.decoder.final_norm.g.item() == 3.0
    torch.testing.assert_close(model(src, tgt), 3.0 * cos)


# ---- impossible combinations (one line, `<key>: <what>`: normlab.errors) ----------------------
@pytest.mark.parametrize("kw, pattern", [
    (dict(init="admin", norm={"placement": "pre"}), r"^init: admin with norm\.placement=pre: "),
    (dict(init="admin", norm={"placement": "deepnorm"}), r"^init: admin with norm\.placement=deepnorm: "),
    (dict(norm={"placement": "rezero"}), r"^norm\.type: layernorm with norm\.placement=rezero: "),
    (dict(norm={"placement": "pre", "type": "none"}), r"^norm\.type: none with norm\.placement=pre: "),
    (dict(layer_aggregation="dlcl", norm={"placement": "resi_dual"}),
     r"^model\.layer_aggregation: dlcl with norm\.placement=resi_dual: "),
    (dict(layer_aggregation="dlcl", init="admin"), r"^model\.layer_aggregation: dlcl with init=admin: "),
    (dict(layer_aggregation="dlcl", regularizer={"decoder_layerdrop": 0.2}),
     r"^regularizer\.decoder_layerdrop: 0\.2 with model\.layer_aggregation=dlcl on the decoder"),
    # DenseFormer's DWA: each of these schemes has its own cross-layer connection; LayerDrop as DLCL
    (dict(layer_aggregation="dwa", norm={"placement": "resi_dual"}),
     r"^model\.layer_aggregation: dwa with norm\.placement=resi_dual: "),
    (dict(layer_aggregation="dwa", norm={"placement": "b2t"}),
     r"^model\.layer_aggregation: dwa with norm\.placement=b2t: "),
    (dict(layer_aggregation="dwa", regularizer={"encoder_layerdrop": 0.1}),
     r"^regularizer\.encoder_layerdrop: 0\.1 with model\.layer_aggregation=dwa on the encoder: .*DWA's"),
    (dict(layer_aggregation="dense"), r"^model\.layer_aggregation: 'dense' is not valid \(allowed: none, dlcl, dwa, attnres\)$"),
    (dict(layer_aggregation="dlcl", layer_aggregation_stacks="middle"),
     r"^model\.layer_aggregation_stacks: 'middle' is not valid"),
])
def test_impossible_combinations_fail_naming_the_keys(kw, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        tiny(**kw)
    assert "\n" not in str(e.value)


def test_possible_combinations_build():
    tiny(layer_aggregation="dlcl", layer_aggregation_stacks="encoder", regularizer={"decoder_layerdrop": 0.2})
    tiny(norm={"placement": "rezero", "type": "none", "fixnorm": True}, layer_aggregation="dlcl")
    tiny(norm={"placement": "deepnorm", "type": "dyt"}, regularizer={"encoder_layerdrop": 0.3, "drophead": 0.2})
    # DWA: LayerDrop on the other stack; Admin (its profile runs at init, where DWA is the identity);
    # Mix-LN (DWA has one form for every block); ReZero without a norm
    tiny(layer_aggregation="dwa", layer_aggregation_stacks="encoder", regularizer={"decoder_layerdrop": 0.2})
    tiny(layer_aggregation="dwa", init="admin", norm={"placement": "post"})
    tiny(layer_aggregation="dwa", norm={"placement": "mix", "mix_ratio": 0.5})
    tiny(layer_aggregation="dwa", norm={"placement": "rezero", "type": "none"})


ARMS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "arm").glob("*.yaml"))


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_file_builds_trains_a_step_and_decodes(arm):
    from normlab.run_config import model_config_from_hydra
    from normlab.decoding.greedy import greedy_decode

    from conftest import compose_cfg

    cfg = compose_cfg([f"+arm={arm}", "model.d_model=16", "model.encoder_ffn=24", "model.decoder_ffn=24",
                       "model.encoder_layers=2", "model.decoder_layers=2"])
    torch.manual_seed(0)
    model = Seq2SeqTransformer(model_config_from_hydra(cfg, vocab_size=V))
    src, tgt = batch()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = nn.functional.cross_entropy(model(src, tgt).flatten(0, 1), tgt.roll(-1, 1).flatten())
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and model(src, tgt).isfinite().all()
    out = greedy_decode(model.eval(), src, max_len_a=0.0, max_len_b=4)
    assert len(out) == 3 and all(len(h) <= 4 for h in out)
