import subprocess
import sys

import pytest
import torch
from torch import nn

from normlab.config import ModelConfig
from normlab.model.attention import MultiheadAttention
from normlab.model.norms import RMSNorm, ScaleNorm
from normlab.model.residual import ResidualBlock
from normlab.model.transformer import DecoderLayer, EncoderLayer, Seq2SeqTransformer

V, PAD, BOS, EOS = 23, 0, 1, 2


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_heads=4,
                decoder_heads=2, encoder_ffn=24, decoder_ffn=20, max_positions=64)
    return ModelConfig(**{**base, **kw})


def batch(B=3, S=7, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (B, S), generator=g)
    tgt = torch.randint(3, V, (B, T), generator=g)
    src[0, 4:] = PAD  # ragged lengths
    src[1, 6:] = PAD
    tgt[0, 3:] = PAD
    return src, tgt


def _copy_attention(ours: MultiheadAttention, ref: nn.MultiheadAttention):
    if ref._qkv_same_embed_dim:
        wq, wk, wv = ref.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight
    bq, bk, bv = ref.in_proj_bias.chunk(3)
    for lin, w, b in [(ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv),
                      (ours.out_proj, ref.out_proj.weight, ref.out_proj.bias)]:
        lin.weight.data.copy_(w.data)
        lin.bias.data.copy_(b.data)


def _copy(dst: nn.Module, src: nn.Module):
    dst.load_state_dict(src.state_dict())


def _copy_torch_layer(ours: nn.Module, ref: nn.Module):
    # torch's Transformer{Encoder,Decoder}Layer -> ours; its norms are randomised first so that
    # a missed copy of a norm's weight or bias shows.
    for m in ref.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    blocks = [ours.self_attn, ours.ffn]
    _copy_attention(ours.self_attn.sublayer, ref.self_attn)
    if hasattr(ref, "multihead_attn"):
        _copy_attention(ours.cross_attn.sublayer, ref.multihead_attn)
        blocks.insert(1, ours.cross_attn)
    _copy(ours.ffn.sublayer.fc1, ref.linear1)
    _copy(ours.ffn.sublayer.fc2, ref.linear2)
    for i, block in enumerate(blocks, start=1):
        _copy(block.norm, getattr(ref, f"norm{i}"))


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_encoder_layer_equals_torch(placement):
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, batch_first=True,
                                     norm_first=placement == "pre").eval()
    ours = EncoderLayer(tiny(norm={"placement": placement}), 16, 4, 24).eval()
    _copy_torch_layer(ours, ref)
    x = torch.randn(3, 7, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 4:] = True
    pad[2, 5:] = True
    expected = ref(x, src_key_padding_mask=pad)  # grad enabled: torch's exact (non-fast) path
    torch.testing.assert_close(ours(x, pad), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_decoder_layer_equals_torch(placement):
    torch.manual_seed(1)
    ref = nn.TransformerDecoderLayer(16, 2, 20, dropout=0.0, batch_first=True,
                                     norm_first=placement == "pre").eval()
    ours = DecoderLayer(tiny(norm={"placement": placement}), 16, 2, 20, memory_dim=16).eval()
    _copy_torch_layer(ours, ref)
    x, memory = torch.randn(3, 6, 16), torch.randn(3, 7, 16)
    mem_pad = torch.zeros(3, 7, dtype=torch.bool)
    mem_pad[1, 3:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    expected = ref(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mem_pad)
    torch.testing.assert_close(ours(x, memory, mem_pad), expected, atol=1e-5, rtol=1e-5)


def test_cross_attention_with_other_key_width_equals_torch():
    torch.manual_seed(2)
    ref = nn.MultiheadAttention(12, 3, kdim=20, vdim=20, batch_first=True)
    ours = MultiheadAttention(12, 3, kdim=20, vdim=20, kind="cross")
    _copy_attention(ours, ref)
    q, mem = torch.randn(2, 5, 12), torch.randn(2, 9, 20)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, 6:] = True
    expected, _ = ref(q, mem, mem, key_padding_mask=pad)
    torch.testing.assert_close(ours(q, mem, key_padding_mask=pad), expected, atol=1e-5, rtol=1e-5)


def test_key_mask_built_once_follows_a_changed_or_new_pad_mask():
    # The SDPA mask is memoised per key_padding_mask object (attention._KeyMask): a mask changed in
    # place, or another mask, must be seen, as must the same mask under inference mode.
    torch.manual_seed(0)
    attn = MultiheadAttention(16, 2).eval()
    x = torch.randn(2, 5, 16)
    pad = torch.zeros(2, 5, dtype=torch.bool)

    def fresh(p):  # the attention with a mask the memo has never seen (it memoises that one)
        return attn(x, key_padding_mask=p.clone())

    expected = fresh(pad)
    first = attn(x, key_padding_mask=pad)
    assert torch.equal(first, expected) and torch.equal(attn(x, key_padding_mask=pad), first)  # memoised
    pad[0, 3:] = True  # in place: the memoised mask is stale
    changed = attn(x, key_padding_mask=pad)
    assert torch.equal(changed, fresh(pad)) and not torch.equal(changed, first)
    assert torch.equal(attn(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)), first)
    with torch.inference_mode():
        inf_pad = pad.clone()
        assert torch.equal(attn(x, key_padding_mask=inf_pad), changed)
    # a normal mask first seen in inference mode: a later grad-mode call must not get an inference tensor
    from normlab.model.attention import _KeyMask

    memo, plain = _KeyMask(), torch.zeros(2, 3, dtype=torch.bool)
    with torch.inference_mode():
        memo(plain)
    assert not memo(plain).is_inference() and memo(plain) is memo(plain)


def test_residual_block_formulas():
    torch.manual_seed(3)
    f, norm = nn.Linear(8, 8), RMSNorm(8)
    norm.weight.data.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8)
    post = ResidualBlock(f, norm, 8, "post", dropout=0.0)
    pre = ResidualBlock(f, norm, 8, "pre", dropout=0.0)
    admin = ResidualBlock(f, norm, 8, "post", dropout=0.0, omega=True)
    admin.omega.data.uniform_(1.5, 3.0)
    torch.testing.assert_close(post(x), norm(x + f(x)))
    torch.testing.assert_close(pre(x), x + f(norm(x)))
    torch.testing.assert_close(admin(x), norm(x * admin.omega + f(x)))
    with pytest.raises(ValueError):
        ResidualBlock(f, norm, 8, "pre", dropout=0.0, omega=True)


def test_residual_ratio_hooks_are_exact_and_removed():
    from normlab.callbacks.diagnostics import RatioHooks

    model = Seq2SeqTransformer(tiny(norm={"placement": "pre"})).eval()
    src, tgt = batch()
    before = model(src, tgt)
    hooks = RatioHooks(model)
    torch.testing.assert_close(model(src, tgt), before)  # hooks observe, never change
    ratios = hooks.close()
    assert len(ratios) == 2 * 2 + 2 * 3
    block = model.encoder.layers[1].ffn
    pad = src.eq(PAD)
    x = model.encoder.layers[1].self_attn(model.encoder.layers[0](model.encoder.embed(src), pad), key_padding_mask=pad)
    assert ratios["enc.1.ffn"] == pytest.approx((block.sublayer(block.norm(x)).norm() / x.norm()).item(), rel=1e-5)
    assert all(not b._forward_pre_hooks and not b.sublayer._forward_hooks for _, b in model.residual_blocks())


def test_head_mask_zeroes_a_heads_contribution():
    torch.manual_seed(4)
    attn = MultiheadAttention(12, 3).eval()
    x = torch.randn(2, 5, 12)
    torch.testing.assert_close(attn(x, head_mask=torch.ones(2, 3)), attn(x))
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    masked = attn(x, head_mask=mask)
    attn.out_proj.weight.data[:, 4:8] = 0.0  # the output-projection columns that read head 1
    torch.testing.assert_close(masked[0], attn(x)[0])
    assert not torch.allclose(masked[1], attn(x)[1])


def test_injected_drophead_acts_on_head_outputs_only_in_training_with_positive_p():
    from normlab.regularizers.drophead import DropHead

    calls = []

    class ZeroHeads(DropHead):  # records its calls; drops every head when active
        def forward(self, heads):
            calls.append(heads.shape)
            return super().forward(heads) * 0.0 if self.training and self.p > 0 else heads

    attn = MultiheadAttention(8, 2, drophead=ZeroHeads(0.0))
    x = torch.randn(3, 4, 8)
    plain = MultiheadAttention(8, 2)
    plain.load_state_dict(attn.state_dict())
    attn.train()
    torch.testing.assert_close(attn(x), plain(x))  # p = 0
    attn.drophead.p = 0.5
    attn.eval()
    torch.testing.assert_close(attn(x), plain.eval()(x))
    attn.train()
    torch.testing.assert_close(attn(x), attn.out_proj.bias.expand(3, 4, 8))  # every head dropped
    assert calls == [(3, 2, 4, 4)] * 3  # (B, H, T, Dh), before the heads are merged
    assert isinstance(MultiheadAttention(8, 2).drophead, nn.Identity)


def test_content_at_pad_positions_does_not_change_real_outputs():
    model = Seq2SeqTransformer(tiny(norm={"placement": "pre"})).eval()
    src, tgt = batch()
    memory, pad = model.encode(src)
    logits = model.decode(tgt, memory, pad)
    garbage = memory.masked_fill(pad[..., None], 100.0)  # the decoder ignores padded memory
    torch.testing.assert_close(model.decode(tgt, garbage, pad), logits)
    assert not torch.allclose(model.decode(tgt, garbage, torch.zeros_like(pad)), logits)
    with torch.no_grad():  # pad tokens now embed to something large instead of zero
        model.encoder.embed.tokens.weight[PAD] = torch.randn(16) * 10
    memory2, pad2 = model.encode(src)
    assert torch.equal(pad2, pad) and not torch.allclose(memory2[pad], memory[pad])
    torch.testing.assert_close(memory2[~pad], memory[~pad])
    real = tgt.ne(PAD)  # (the tied output's PAD column changed with the row, so skip it)
    torch.testing.assert_close(model.decode(tgt, memory2, pad)[real][:, PAD + 1:], logits[real][:, PAD + 1:])


def test_future_target_tokens_do_not_change_earlier_logits():
    model = Seq2SeqTransformer(tiny()).eval()
    src, tgt = batch()
    logits = model(src, tgt)
    tgt2 = tgt.clone()
    tgt2[:, 4] = (tgt2[:, 4] + 1 - 3) % (V - 3) + 3
    logits2 = model(src, tgt2)
    torch.testing.assert_close(logits2[:, :4], logits[:, :4])
    assert not torch.allclose(logits2[:, 4:], logits[:, 4:])


@pytest.mark.parametrize("placement", ["post", "pre"])
@pytest.mark.parametrize("norm_type", ["layernorm", "scalenorm", "rmsnorm"])
@pytest.mark.parametrize("fixnorm", [False, True])
def test_every_variant_trains_one_step(placement, norm_type, fixnorm):
    torch.manual_seed(5)
    cfg = tiny(norm={"type": norm_type, "placement": placement, "fixnorm": fixnorm},
               dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)
    model = Seq2SeqTransformer(cfg).train()
    norm_cls = {"layernorm": nn.LayerNorm, "scalenorm": ScaleNorm, "rmsnorm": RMSNorm}[norm_type]
    n_norms = sum(isinstance(m, norm_cls) for m in model.modules())
    assert n_norms == 2 * 2 + 3 * 2 + (2 if placement == "pre" else 0)  # + final norm per stack
    src, tgt = batch()
    logits = model(src, tgt)
    loss = nn.functional.cross_entropy(logits.reshape(-1, V), src.new_full((3 * 6,), 5))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.decoder.layers[0].ffn.sublayer.fc1.weight.grad.abs().sum() > 0


def test_admin_adds_trainable_omega_to_every_residual():
    model = Seq2SeqTransformer(tiny(init="admin"))
    blocks = [m for m in model.modules() if isinstance(m, ResidualBlock)]
    assert len(blocks) == 2 * 2 + 2 * 3
    assert all(b.omega is not None and b.omega.shape == (16,) and torch.equal(b.omega, torch.ones(16))
               for b in blocks)
    src, tgt = batch()
    model(src, tgt).sum().backward()
    assert all(b.omega.grad is not None and b.omega.grad.abs().sum() > 0 for b in blocks)
    assert all(b.omega is None for b in Seq2SeqTransformer(tiny()).modules() if isinstance(b, ResidualBlock))


def test_different_encoder_and_decoder_widths():
    cfg = tiny(decoder_d_model=24, decoder_heads=3, share_embeddings=False)
    model = Seq2SeqTransformer(cfg)
    src, tgt = batch()
    memory, pad = model.encode(src)
    assert memory.shape == (3, 7, 16) and pad.shape == (3, 7)
    logits = model(src, tgt)
    assert logits.shape == (3, 6, V)
    logits.sum().backward()
    cross = model.decoder.layers[0].cross_attn.sublayer
    assert cross.k_proj.weight.shape == (24, 16) and cross.k_proj.weight.grad is not None
    assert model.output_projection.tied is model.decoder.embed.tokens
    assert model.encoder.embed.tokens is not model.decoder.embed.tokens


def test_parameter_count_matches_hand_count_and_tying():
    d, f_enc, f_dec = 16, 24, 20
    enc_layer = 4 * (d * d + d) + (d * f_enc + f_enc + f_enc * d + d) + 2 * 2 * d
    dec_layer = 8 * (d * d + d) + (d * f_dec + f_dec + f_dec * d + d) + 3 * 2 * d
    expected = V * d + 2 * enc_layer + 2 * dec_layer  # one shared embedding, sinusoids have none
    assert Seq2SeqTransformer(tiny()).num_parameters() == expected
    untied = Seq2SeqTransformer(tiny(share_embeddings=False, tie_output_embeddings=False))
    assert untied.num_parameters() == expected + 2 * V * d
    learned = Seq2SeqTransformer(tiny(learned_positions=True))
    assert learned.num_parameters() == expected + 2 * 64 * d


def test_xavier_init_values():
    model = Seq2SeqTransformer(tiny())
    emb = model.encoder.embed.tokens.weight
    assert torch.equal(emb[PAD], torch.zeros(16))
    assert emb[3:].std().item() == pytest.approx(16 ** -0.5, rel=0.15)
    fc1 = model.encoder.layers[0].ffn.sublayer.fc1
    bound = (6 / (16 + 24)) ** 0.5
    assert fc1.weight.abs().max().item() <= bound and fc1.weight.abs().max().item() > 0.8 * bound
    assert torch.equal(fc1.bias, torch.zeros(24))


def test_rebuild_from_config_dict_reproduces_outputs():
    model = Seq2SeqTransformer(tiny(norm={"type": "scalenorm", "placement": "pre", "fixnorm": True})).eval()
    clone = Seq2SeqTransformer.from_config_dict(model.cfg.to_dict()).eval()
    clone.load_state_dict(model.state_dict())
    assert clone.cfg == model.cfg
    src, tgt = batch()
    torch.testing.assert_close(clone(src, tgt), model(src, tgt))


def test_positions_beyond_max_positions_fail_clearly():
    model = Seq2SeqTransformer(tiny(max_positions=8))
    with pytest.raises(ValueError, match="max_positions"):
        model.encode(torch.full((1, 9), 5))


def test_dropout_only_in_training():
    model = Seq2SeqTransformer(tiny(dropout=0.3, attention_dropout=0.3, activation_dropout=0.3))
    src, tgt = batch()
    model.eval()
    torch.testing.assert_close(model(src, tgt), model(src, tgt))
    model.train()
    assert not torch.allclose(model(src, tgt), model(src, tgt))


def test_model_package_imports_neither_lightning_nor_hydra():
    # A checkpoint must rebuild the model in a plain Python session (design: arrows run one way).
    code = ("import sys, normlab.model.transformer, normlab.decoding.greedy; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'hydra')]; "
            "sys.exit(f'imported: {bad}' if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
