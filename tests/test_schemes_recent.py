"""The 2023-2025 residual schemes (issue 20, item 2): each against its paper's formula with hand-set
weights, its refused combinations, LayerDrop (a skipped layer is the identity; the kept layers are
the pruned model) and pruning that keeps what each layer trained with, through save and load.
Cached == uncached decoding: tests/test_beam.py; diagnostics: tests/test_diagnostics.py; a tiny
training run: tests/test_norm_runs.py."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normlab.checkpoint import load_model, save_model
from normlab.config import ConfigError, ModelConfig
from normlab.model.attention import MultiheadAttention
from normlab.model.qk_norms import QKVNorm
from normlab.model.norms import RMSNorm
from normlab.model.residual import ResidualBlock
from normlab.model.transformer import DecoderLayer, EncoderLayer, Seq2SeqTransformer
from normlab.regularizers.pruning import prune

from test_arms import batch, norm, randomise_, tiny

D = 8
NEW = {"b2t": {}, "reordered": {}, "pre_scaled": {}, "mix": {}, "hybrid": {}, "hybrid_star": {}}  # placement -> extra norm settings of the model-level tests


def block(placement: str, f: nn.Module, n: nn.Module, **state) -> ResidualBlock:
    return ResidualBlock(f, n, D, placement, 0.0, **state)


def fixed(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def linear(seed: int) -> nn.Linear:
    f = nn.Linear(D, D)
    with torch.no_grad():
        f.weight.copy_(fixed(seed, D, D) / D ** 0.5)
        f.bias.copy_(fixed(seed + 1, D))
    return f


def residuals(layer: nn.Module) -> list[ResidualBlock]:
    return [m for m in layer.children() if isinstance(m, ResidualBlock)]


def model_cfg(placement: str, **kw) -> ModelConfig:
    return tiny(norm={"placement": placement, **NEW.get(placement, {}), **kw.pop("norm", {})}, **kw)


# ---- B2T (Takase et al. 2023) ----------------------------------------------------------------------
def test_b2t_block_adds_the_layer_input_before_its_norm():
    f, n, x, x0 = linear(1), norm(2), fixed(3, 2, 3, D), fixed(4, 2, 3, D)
    b = block("b2t", f, n)
    torch.testing.assert_close(b(x), n(x + f(x)))  # a block that is not the layer's last: post-norm
    torch.testing.assert_close(b(x, layer_input=x0), n(x + f(x) + x0))


def test_b2t_encoder_and_decoder_layers_are_the_papers_formula():
    cfg = model_cfg("b2t", d_model=D, decoder_d_model=D)
    torch.manual_seed(0)
    enc = randomise_(EncoderLayer(cfg, D, 2, 12)).eval()
    x = fixed(5, 2, 4, D)
    pad = torch.zeros(2, 4, dtype=torch.bool)
    attn, ffn = residuals(enc)
    h = attn.norm(x + attn.sublayer(x, key_padding_mask=pad))
    torch.testing.assert_close(enc(x, pad), ffn.norm(h + ffn.sublayer(h) + x))
    dec = randomise_(DecoderLayer(cfg, D, 2, 12, memory_dim=D)).eval()
    memory, y = fixed(6, 2, 4, D), fixed(7, 2, 3, D)
    self_attn, cross, ffn = residuals(dec)
    h = self_attn.norm(y + self_attn.sublayer(y, causal=True))
    h = cross.norm(h + cross.sublayer(h, memory, key_padding_mask=pad))
    torch.testing.assert_close(dec(y, memory, pad), ffn.norm(h + ffn.sublayer(h) + y))


# ---- reordered norm (OLMo 2 2024; Swin v2) -------------------------------------------------------
def test_reordered_block_normalises_the_branch_output_and_the_stack_ends_in_a_norm():
    f, n, x = linear(1), norm(2), fixed(3, 2, 3, D)
    b = block("reordered", f, n)
    torch.testing.assert_close(b(x), x + n(f(x)))
    torch.testing.assert_close(b(x, layer_input=fixed(4, 2, 3, D)), x + n(f(x)))  # no B2T skip
    m = Seq2SeqTransformer(model_cfg("reordered"))
    assert isinstance(m.encoder.final_norm, nn.LayerNorm) and isinstance(m.decoder.final_norm, nn.LayerNorm)


# ---- LayerNorm Scaling (Sun et al. 2025) ----------------------------------------------------------
def test_pre_scaled_block_multiplies_the_norm_output_by_its_scale():
    f, n, x = linear(1), norm(2), fixed(3, 2, 3, D)
    torch.testing.assert_close(block("pre_scaled", f, n, ln_scale=0.25)(x), x + f(n(x) * 0.25))
    assert block("pre_scaled", f, n).ln_scale == 1.0  # a block alone: layer 1


def test_pre_scaled_layer_l_of_each_stack_scales_by_one_over_root_l():
    m = Seq2SeqTransformer(model_cfg("pre_scaled", encoder_layers=4, decoder_layers=2))
    for stack in (m.encoder, m.decoder):
        for i, layer in enumerate(stack.layers):
            assert {round(b.ln_scale.item(), 6) for b in residuals(layer)} == {round(1 / (i + 1) ** 0.5, 6)}
    assert "encoder.layers.3.ffn.ln_scale" in m.state_dict()  # persistent: kept by checkpoints and pruning
    assert type(m.encoder.final_norm) is nn.LayerNorm


# ---- Mix-LN (Li et al. 2025) ----------------------------------------------------------------------
def test_mix_block_is_post_norm_or_pre_norm_as_it_was_built():
    f, n, x = linear(1), norm(2), fixed(3, 2, 3, D)
    torch.testing.assert_close(block("mix", f, n, post_norm=True)(x), n(x + f(x)))
    torch.testing.assert_close(block("mix", f, n, post_norm=False)(x), x + f(n(x)))


@pytest.mark.parametrize("ratio, n, posts", [(0.25, 6, 1), (0.25, 3, 0), (0.5, 4, 2), (0.29, 100, 29), (0.0, 6, 0),
                                             (1.0, 6, 6)])
def test_mix_post_norm_in_the_first_floor_alpha_l_layers_of_each_stack(ratio, n, posts):
    m = Seq2SeqTransformer(model_cfg("mix", encoder_layers=n, decoder_layers=2, norm={"mix_ratio": ratio}))
    assert [l.self_attn.post_norm_layer for l in m.encoder.layers] == [i < posts for i in range(n)]
    assert {b.post_norm_layer for b in residuals(m.encoder.layers[0])} == {posts > 0}
    assert [l.ffn.post_norm_layer for l in m.decoder.layers] == [i < int(ratio * 2) for i in range(2)]
    assert type(m.encoder.final_norm) is type(m.decoder.final_norm) is nn.LayerNorm  # for every α


def test_mix_at_ratio_zero_is_pre_norm():
    src, tgt = batch()
    torch.manual_seed(0)
    mix = Seq2SeqTransformer(model_cfg("mix", norm={"mix_ratio": 0.0})).eval()
    torch.manual_seed(0)
    pre = Seq2SeqTransformer(model_cfg("pre")).eval()
    assert torch.equal(mix(src, tgt), pre(src, tgt))


def test_mix_layers_keep_their_choice_through_pruning_save_and_load(tmp_path):
    m = Seq2SeqTransformer(model_cfg("mix", encoder_layers=4, decoder_layers=4))  # α = 0.25: layer 0 post-norm
    pruned = prune(m, [0, 2], [0, 3])  # rebuilt with 2 layers, ⌊0.25·2⌋ = 0 would make every layer pre-norm
    loaded, _ = load_model(save_model(tmp_path / "pruned.ckpt", pruned, tokenizer_proto=None))
    for model in (pruned, loaded):
        for stack in (model.encoder, model.decoder):
            assert [l.ffn.post_norm_layer for l in stack.layers] == [True, False]


# ---- HybridNorm (Zhuo et al. 2025) ------------------------------------------------------------------
def test_hybrid_ffn_block_normalises_its_input_and_its_skip():
    f, n, x = linear(1), norm(2), fixed(3, 2, 3, D)
    torch.testing.assert_close(block("hybrid", f, n)(x), n(x) + f(n(x)))
    torch.testing.assert_close(block("hybrid", f, n)(x, layer_input=fixed(4, 2, 3, D)), n(x) + f(n(x)))


def attention_by_hand(attn: MultiheadAttention, x, memory=None, pad=None, causal=False):
    # softmax(N(Q)N(K)ᵀ/√Dh)N(V) per head, from the module's weights, without its code path.
    heads, dh = attn.num_heads, attn.head_dim
    kv = x if memory is None else memory
    split = lambda t: t.unflatten(-1, (heads, dh)).transpose(1, 2)  # (B, H, T, Dh)
    qkv = attn.qkv_norm
    q = qkv.q_norm(split(x @ attn.q_proj.weight.T + attn.q_proj.bias))
    k = qkv.k_norm(split(kv @ attn.k_proj.weight.T + attn.k_proj.bias))
    v = qkv.v_norm(split(kv @ attn.v_proj.weight.T + attn.v_proj.bias))
    logits = q @ k.transpose(-1, -2) / math.sqrt(dh)  # (B, H, T, S)
    if pad is not None:
        logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
    if causal:
        logits = logits.masked_fill(torch.ones(x.size(1), kv.size(1), dtype=torch.bool).triu(1), float("-inf"))
    out = (logits.softmax(-1) @ v).transpose(1, 2).flatten(2)  # (B, T, D)
    return out @ attn.out_proj.weight.T + attn.out_proj.bias


def ffn_by_hand(ffn, x):
    return F.relu(x @ ffn.fc1.weight.T + ffn.fc1.bias) @ ffn.fc2.weight.T + ffn.fc2.bias


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_hybrid_encoder_and_decoder_layers_are_the_papers_formula(norm_type):
    # Fig. 1(d): h = N(x + Attn_QKV(x)), out = h + FFN(h); in the decoder h after self- and cross-attention.
    cfg = model_cfg("hybrid", d_model=D, decoder_d_model=D, norm={"type": norm_type})
    torch.manual_seed(0)
    enc = randomise_(EncoderLayer(cfg, D, 2, 12)).eval()
    x = fixed(5, 2, 4, D)
    pad = torch.tensor([[False] * 4, [False, False, False, True]])
    attn, ffn = residuals(enc)
    assert isinstance(attn.norm, nn.Identity) and isinstance(attn.sublayer.qkv_norm, QKVNorm)
    assert isinstance(ffn.norm, nn.LayerNorm if norm_type == "layernorm" else RMSNorm)
    assert ffn.norm.weight.shape == (D,) and attn.sublayer.qkv_norm.v_norm.weight.shape == (D // 2,)  # per head
    h = ffn.norm(x + attention_by_hand(attn.sublayer, x, pad=pad))
    torch.testing.assert_close(enc(x, pad), h + ffn_by_hand(ffn.sublayer, h))
    dec = randomise_(DecoderLayer(cfg, D, 2, 12, memory_dim=D)).eval()
    memory, y = fixed(6, 2, 4, D), fixed(7, 2, 3, D)
    self_attn, cross, ffn = residuals(dec)
    h = y + attention_by_hand(self_attn.sublayer, y, causal=True)
    h = ffn.norm(h + attention_by_hand(cross.sublayer, h, memory, pad=pad))
    torch.testing.assert_close(dec(y, memory, pad), h + ffn_by_hand(ffn.sublayer, h))


def test_hybrid_stacks_end_in_a_norm_and_every_parameter_trains():
    m = Seq2SeqTransformer(model_cfg("hybrid", norm={"type": "rmsnorm"}))
    assert type(m.encoder.final_norm) is type(m.decoder.final_norm) is RMSNorm
    src, tgt = batch()
    m(src, tgt).logsumexp(-1).mean().backward()
    assert [n for n, p in m.named_parameters() if p.grad is None] == []  # no unused norm (DDP)
    assert not any(n.endswith("self_attn.norm.weight") or n.endswith("cross_attn.norm.weight") for n in m.state_dict())


def test_hybrid_cache_holds_normalised_keys_and_values_and_decodes_exactly():
    # Norm gains and biases away from 1 and 0: normalising the cached prefix a second time would show.
    torch.manual_seed(0)
    m = randomise_(Seq2SeqTransformer(model_cfg("hybrid"))).eval()
    src, tgt = batch()
    memory, pad = m.encode(src)
    cache = m.new_cache()
    steps = torch.cat([m.decode(tgt[:, i:i + 1], memory, pad, cache) for i in range(tgt.size(1))], dim=1)
    torch.testing.assert_close(steps, m.decode(tgt, memory, pad))
    layer = m.decoder.layers[0]
    for attn, source in ((layer.self_attn.sublayer, m.decoder.embed(tgt)), (layer.cross_attn.sublayer, memory)):
        state = cache.source_state(attn) if attn.kind == "cross" else cache.state(attn)
        torch.testing.assert_close(state["k"], attn.qkv_norm.k_norm(attn._split(attn.k_proj(source))))
        torch.testing.assert_close(state["v"], attn.qkv_norm.v_norm(attn._split(attn.v_proj(source))))


# ---- HybridNorm* (Zhuo et al. 2025; the authors' norm_pos_special_config) ---------------------------
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_hybrid_star_first_layer_is_pre_norm_with_qkv_norm_and_the_others_hybridnorm(norm_type):
    # Layer 0 (authors' code: attn_norm, no ffn_residual, QKV-norm model-wide): h = x + Attn_QKV(N(x)),
    # out = h + FFN(N(h)); layer 1: HybridNorm's h = N(x + Attn_QKV(x)), out = h + FFN(h).
    cfg = model_cfg("hybrid_star", d_model=D, decoder_d_model=D, norm={"type": norm_type})
    x, memory, y = fixed(5, 2, 4, D), fixed(6, 2, 4, D), fixed(7, 2, 3, D)
    pad = torch.tensor([[False] * 4, [False, False, False, True]])
    torch.manual_seed(0)
    enc0, enc1 = (randomise_(EncoderLayer(cfg, D, 2, 12, index=i)).eval() for i in (0, 1))
    attn, ffn = residuals(enc0)
    assert isinstance(attn.norm, nn.LayerNorm if norm_type == "layernorm" else RMSNorm)
    assert isinstance(attn.sublayer.qkv_norm, QKVNorm)
    h = x + attention_by_hand(attn.sublayer, attn.norm(x), pad=pad)
    torch.testing.assert_close(enc0(x, pad), h + ffn_by_hand(ffn.sublayer, ffn.norm(h)))
    attn, ffn = residuals(enc1)
    assert isinstance(attn.norm, nn.Identity)
    h = ffn.norm(x + attention_by_hand(attn.sublayer, x, pad=pad))
    torch.testing.assert_close(enc1(x, pad), h + ffn_by_hand(ffn.sublayer, h))
    dec0, dec1 = (randomise_(DecoderLayer(cfg, D, 2, 12, memory_dim=D, index=i)).eval() for i in (0, 1))
    self_attn, cross, ffn = residuals(dec0)
    h = y + attention_by_hand(self_attn.sublayer, self_attn.norm(y), causal=True)
    h = h + attention_by_hand(cross.sublayer, cross.norm(h), memory, pad=pad)
    torch.testing.assert_close(dec0(y, memory, pad), h + ffn_by_hand(ffn.sublayer, ffn.norm(h)))
    self_attn, cross, ffn = residuals(dec1)
    h = y + attention_by_hand(self_attn.sublayer, y, causal=True)
    h = ffn.norm(h + attention_by_hand(cross.sublayer, h, memory, pad=pad))
    torch.testing.assert_close(dec1(y, memory, pad), h + ffn_by_hand(ffn.sublayer, h))


def test_hybrid_star_with_one_layer_per_stack_is_pre_norm_with_qkv_norm():
    # the limit case: every layer is the first, so no block is HybridNorm's; the same weights in a
    # pre-norm model whose attentions carry the same QKV norms compute the same
    src, tgt = batch()
    torch.manual_seed(0)
    star = randomise_(Seq2SeqTransformer(model_cfg("hybrid_star", encoder_layers=1, decoder_layers=1))).eval()
    pre = Seq2SeqTransformer(model_cfg("pre", encoder_layers=1, decoder_layers=1)).eval()
    for a, b in zip(star.modules(), pre.modules()):
        if isinstance(a, MultiheadAttention):
            b.qkv_norm = a.qkv_norm
    pre.load_state_dict(star.state_dict(), strict=False)
    assert torch.equal(star(src, tgt), pre(src, tgt))


def test_hybrid_star_input_norms_only_in_each_stacks_first_layer_and_every_parameter_trains():
    m = Seq2SeqTransformer(model_cfg("hybrid_star", encoder_layers=3, decoder_layers=2, norm={"type": "rmsnorm"}))
    assert sorted(k for k in m.state_dict() if k.endswith("attn.norm.weight")) == [
        "decoder.layers.0.cross_attn.norm.weight", "decoder.layers.0.self_attn.norm.weight",
        "encoder.layers.0.self_attn.norm.weight"]
    assert [[b.pre_norm_layer for b in residuals(l)] for l in m.encoder.layers] == [[True] * 2, [False] * 2, [False] * 2]
    assert type(m.encoder.final_norm) is type(m.decoder.final_norm) is RMSNorm
    src, tgt = batch()
    m(src, tgt).logsumexp(-1).mean().backward()
    assert [n for n, p in m.named_parameters() if p.grad is None] == []  # no unused norm (DDP)


def test_hybrid_star_pruned_without_its_first_layer_reloads_as_it_was_pruned(tmp_path):
    # the rebuilt stack's new first layer gets the input norm; the saved one (old layer 1) has none
    torch.manual_seed(0)
    m = randomise_(Seq2SeqTransformer(model_cfg("hybrid_star", encoder_layers=4, decoder_layers=4))).eval()
    loaded = check_pruned_is_skipped(m, *batch(), tmp_path, keep_e=(1, 3), keep_d=(0, 2))
    first_enc, first_dec = loaded.encoder.layers[0], loaded.decoder.layers[0]
    assert isinstance(first_enc.self_attn.norm, nn.Identity) and not first_enc.ffn.pre_norm_layer
    assert isinstance(first_dec.cross_attn.norm, nn.LayerNorm) and first_dec.ffn.pre_norm_layer


def test_other_placements_have_no_qkv_norm():
    m = Seq2SeqTransformer(model_cfg("pre", qk_norm="rms"))
    assert all(a.qkv_norm is None for a in m.modules() if isinstance(a, MultiheadAttention))
    assert not any(isinstance(a, QKVNorm) for a in m.modules())


def test_qkv_norm_and_qk_norm_are_refused_together_in_the_module():
    from normlab.config import NormConfig
    from normlab.model.qk_norms import RMSQKNorm

    with pytest.raises(ValueError, match="QKV-norm"):
        MultiheadAttention(D, 2, inner_norm=QKVNorm(NormConfig(), D), qk_norm=RMSQKNorm(D // 2, 1e-5))


# ---- every new scheme ---------------------------------------------------------------------------
REFUSED = [("b2t", dict(init="admin"), "init: admin with norm.placement=b2t"),
           ("b2t", dict(layer_aggregation="dlcl"), "model.layer_aggregation: dlcl with norm.placement=b2t"),
           ("reordered", dict(init="admin"), "init: admin with norm.placement=reordered"),
           ("pre_scaled", dict(init="admin"), "init: admin with norm.placement=pre_scaled"),
           ("mix", dict(init="admin"), "init: admin with norm.placement=mix"),
           ("mix", dict(layer_aggregation="dlcl"), "model.layer_aggregation: dlcl with norm.placement=mix"),
           ("mix", dict(norm={"mix_ratio": 1.5}), "norm.mix_ratio: 1.5 is not valid"),
           ("pre", dict(norm={"mix_ratio": 0.5}), "norm.mix_ratio: 0.5 with norm.placement=pre"),
           ("hybrid", dict(init="admin"), "init: admin with norm.placement=hybrid"),
           ("hybrid", dict(layer_aggregation="dlcl"), "model.layer_aggregation: dlcl with norm.placement=hybrid"),
           ("hybrid", dict(qk_norm="rms"), "model.qk_norm: rms with norm.placement=hybrid"),
           ("hybrid", dict(qk_norm="l2"), "model.qk_norm: l2 with norm.placement=hybrid"),
           ("hybrid", dict(norm={"type": "none"}), "norm.type: none with norm.placement=hybrid"),
           ("hybrid_star", dict(init="admin"), "init: admin with norm.placement=hybrid_star"),
           ("hybrid_star", dict(layer_aggregation="dlcl"), "model.layer_aggregation: dlcl with norm.placement=hybrid_star"),
           ("hybrid_star", dict(qk_norm="l2"), "model.qk_norm: l2 with norm.placement=hybrid_star"),
           ("hybrid_star", dict(norm={"mix_ratio": 0.5}), "norm.mix_ratio: 0.5 with norm.placement=hybrid_star")]


@pytest.mark.parametrize("placement, kw, message", REFUSED)
def test_refused_combinations_name_both_keys(placement, kw, message):
    with pytest.raises(ConfigError) as err:
        model_cfg(placement, **kw)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("placement", list(NEW))
def test_layerdrop_skips_layers_whole_and_the_kept_ones_are_the_pruned_model(placement):
    src, tgt = batch()
    reg = dict(encoder_layerdrop=1.0, decoder_layerdrop=1.0)
    torch.manual_seed(0)
    m = Seq2SeqTransformer(model_cfg(placement, encoder_layers=4, decoder_layers=4, regularizer=reg)).train()
    memory, _ = m.encode(src)
    assert m.encoder.layers.last_kept == []  # every layer skipped: the stack is its final norm
    torch.testing.assert_close(memory, m.encoder.final_norm(m.encoder.stream_in(m.encoder.embed(src))))
    m.encoder.layers.p = m.decoder.layers.p = 0.5
    for _ in range(50):  # a draw that keeps some layers and skips others in both stacks
        out = m(src, tgt)
        ke, kd = m.encoder.layers.last_kept, m.decoder.layers.last_kept
        if 0 < len(ke) < 4 and 0 < len(kd) < 4:
            break
    else:
        pytest.fail("no draw kept some layers of both stacks")
    torch.testing.assert_close(out, prune(m, ke, kd).eval()(src, tgt))


@pytest.mark.parametrize("placement", list(NEW))
def test_a_pruned_model_keeps_each_layers_behaviour_through_save_and_load(placement, tmp_path):
    torch.manual_seed(0)
    m = randomise_(Seq2SeqTransformer(model_cfg(placement, encoder_layers=4, decoder_layers=4))).eval()
    check_pruned_is_skipped(m, *batch(), tmp_path)


def check_pruned_is_skipped(m, src, tgt, tmp_path, keep_e=(1, 3), keep_d=(0, 3)):
    """A 4+4-layer model pruned to keep_e, keep_d computes what it computes with the other layers
    skipped (identities), and again after save and load (rebuilt from its ModelConfig): the
    reloaded pruned model."""
    pruned = prune(m, keep_e, keep_d)
    skipped = prune(m, range(4), range(4))
    for stack, keep in ((skipped.encoder, keep_e), (skipped.decoder, keep_d)):
        for i in set(range(4)) - set(keep):
            stack.layers[i] = Identity()
    torch.testing.assert_close(pruned(src, tgt), skipped(src, tgt), rtol=0, atol=0)
    loaded, _ = load_model(save_model(tmp_path / "pruned.ckpt", pruned, tokenizer_proto=None))
    torch.testing.assert_close(loaded.eval()(src, tgt), pruned(src, tgt), rtol=0, atol=0)
    return loaded


class Identity(nn.Module):
    def forward(self, x, *args, **kwargs):
        return x
