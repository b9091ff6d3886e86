"""model.bias=false (issue 36 item 6): no bias in the attention projections (q, k, v, out of self- and
cross-attention) nor in any norm (LayerNorm's β, DyT's and Derf's β), the FFN keeps its own.

Each test holds against an independent statement: the removed parameters are named by module type
and counted by formula; a bias-free model computes, to the bit, what today's model computes with
those biases at zero (outputs and gradients, under dropout too). Bitwise, not to rounding: a zero
bias adds an exact 0 and F.linear's addmm with a zero bias sums the same products in the same
order as its plain matmul (measured on AVX2 and on `make test-kernels`' scalar / MKL COMPATIBLE
path; this file runs there too)."""
import re

import pytest
import torch
from torch import nn

from normlab.config import ConfigError, ModelConfig
from normlab.init.admin import export_post_norm, profile_omega_
from normlab.model.norms import Derf, DyT
from normlab.model.transformer import Seq2SeqTransformer

from test_attention_features import check_cached_decoding

V, PAD = 23, 0
# Uneven on purpose, so a norm or projection sized by the wrong stack is counted wrong: encoder
# 2 layers of width 16 (4 heads, FFN 24), decoder 3 layers of width 12 (3 heads, FFN 20).
LE, LD, DE, DD, FE, FD, HE, HD = 2, 3, 16, 12, 24, 20, 4, 3
PRE, POST = {"placement": "pre"}, {"placement": "post"}


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=DE, decoder_d_model=DD, share_embeddings=False, encoder_layers=LE,
                decoder_layers=LD, encoder_heads=HE, decoder_heads=HD, encoder_ffn=FE, decoder_ffn=FD,
                max_positions=64, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)
    return ModelConfig(**{**base, **kw})


# The bias entries model.bias=false removes, by formula. Every attention's four projections have
# outputs of its stack's width (cross-attention's too: it maps the encoder's 16 to the decoder's 12).
ATTENTION = LE * 4 * DE + LD * 2 * 4 * DD
BLOCKS = 2 * LE * DE + 3 * LD * DD  # one norm of the stream's width per residual block
FINAL = DE + DD  # a final norm per stack
CASES = {  # name: (ModelConfig options, the norms' bias entries)
    "post": (dict(norm=POST), BLOCKS),
    "pre": (dict(norm=PRE), BLOCKS + FINAL),
    "deepnorm": (dict(norm={"placement": "deepnorm"}), BLOCKS),
    "admin": (dict(norm=POST, init="admin"), BLOCKS),
    "dlcl_pre": (dict(norm=PRE, layer_aggregation="dlcl"), BLOCKS + FINAL + LE * DE + LD * DD),  # + a norm per layer
    "dlcl_post": (dict(norm=POST, layer_aggregation="dlcl"), BLOCKS + LE * DE + LD * DD),
    "rmsnorm": (dict(norm={"placement": "pre", "type": "rmsnorm"}), 0),
    "scalenorm": (dict(norm={"placement": "pre", "type": "scalenorm"}), 0),
    "dyt": (dict(norm={"placement": "pre", "type": "dyt"}), BLOCKS + FINAL),
    "derf": (dict(norm={"placement": "post", "type": "derf"}), BLOCKS),
    "qk_l2": (dict(norm=PRE, qk_norm="l2"), BLOCKS + FINAL),
    "qk_rms": (dict(norm=POST, qk_norm="rms"), BLOCKS),  # RMSNorm of q and k: no bias
    "value_residual": (dict(norm=PRE, value_residual=True), BLOCKS + FINAL),
    "hyper_dynamic": (dict(norm=PRE, residual="hyper", residual_mixing="dynamic"), 2 * BLOCKS + FINAL),  # + N(H)
    "mhc_dynamic": (dict(norm=PRE, residual="mhc", residual_mixing="dynamic"), BLOCKS + FINAL),  # RMSNorm
    "subln": (dict(norm={"placement": "subln"}), BLOCKS + FINAL + LE * (DE + FE) + LD * (DD + FD)),  # no cross
    "sandwich": (dict(norm={"placement": "sandwich"}), 2 * BLOCKS + FINAL),
    "resi_dual": (dict(norm={"placement": "resi_dual"}), BLOCKS + FINAL),
    # attention blocks: q, k, v each normed per head (d/H); FFN blocks: one norm
    "hybrid": (dict(norm={"placement": "hybrid"}), LE * (3 * DE // HE + DE) + LD * (2 * 3 * DD // HD + DD) + FINAL),
    # the first layer of each stack pre-norm: its attention blocks have an input norm too
    "hybrid_star": (dict(norm={"placement": "hybrid_star"}),
                    LE * (3 * DE // HE + DE) + DE + LD * (2 * 3 * DD // HD + DD) + 2 * DD + FINAL),
    "b2t": (dict(norm={"placement": "b2t"}), BLOCKS),
    "reordered": (dict(norm={"placement": "reordered"}), BLOCKS + FINAL),
    "pre_scaled": (dict(norm={"placement": "pre_scaled"}), BLOCKS + FINAL),
    "mix": (dict(norm={"placement": "mix", "mix_ratio": 0.5}), BLOCKS + FINAL),
    "dwa": (dict(norm=PRE, layer_aggregation="dwa"), BLOCKS + FINAL),
    "rezero": (dict(norm={"placement": "rezero", "type": "none"}), 0),
}


def paired(name: str, seed: int = 1) -> tuple[Seq2SeqTransformer, Seq2SeqTransformer]:
    # today's model and the bias-free one, built with the same seed
    torch.manual_seed(seed)
    with_bias = Seq2SeqTransformer(tiny(**CASES[name][0]))
    torch.manual_seed(seed)
    return with_bias, Seq2SeqTransformer(tiny(bias=False, **CASES[name][0]))


def removable(model: nn.Module) -> set[str]:
    """Names of the biases model.bias=false removes, found by module type, not by what it builds."""
    out = set()
    for name, module in model.named_modules():
        attention = name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "out_proj")
        if (attention and isinstance(module, nn.Linear)) or isinstance(module, (nn.LayerNorm, DyT, Derf)):
            out.add(f"{name}.bias")
    return out


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(3, V, (3, 7), generator=g), torch.randint(3, V, (3, 6), generator=g)
    src[0, 4:] = PAD
    tgt[1, 3:] = PAD
    return src, tgt


@pytest.mark.parametrize("name", CASES)
def test_exactly_the_attention_and_norm_biases_go_and_the_count_drops_by_their_entries(name):
    with_bias, without = paired(name)
    names, kept = dict(with_bias.named_parameters()), dict(without.named_parameters())
    removed = removable(with_bias)
    assert set(kept) == set(names) - removed  # nothing else goes, nothing is renamed
    assert any(n.endswith("fc1.bias") for n in kept) and any(n.endswith("fc2.bias") for n in kept)  # the FFN's stay
    entries = ATTENTION + CASES[name][1]
    assert sum(names[n].numel() for n in removed) == entries
    assert with_bias.num_parameters() - without.num_parameters() == entries


@pytest.mark.parametrize("name", CASES)
def test_the_same_seed_gives_the_same_weights_without_the_biases(name):
    """A paired comparison: the bias-free model draws what today's draws (attention._projection),
    so each weight is today's, and today's removed biases start at 0 (DeepNorm's and Sub-LN's
    scaled branches included)."""
    with_bias, without = paired(name)
    names = dict(with_bias.named_parameters())
    for n, p in without.named_parameters():
        assert torch.equal(p, names[n]), n
    assert all(not names[n].any() for n in removable(with_bias))


def randomised_pair(name: str) -> tuple[Seq2SeqTransformer, Seq2SeqTransformer]:
    """Today's model with every parameter moved off its init (norm gains, ω, α, mixing weights, ...)
    and the removed biases set to 0; the bias-free model loads the rest of its weights."""
    with_bias, without = paired(name)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in with_bias.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
            if n in removable(with_bias):
                p.zero_()
    result = without.load_state_dict(with_bias.state_dict(), strict=False)
    assert result.missing_keys == [] and set(result.unexpected_keys) == removable(with_bias)
    return with_bias, without


@pytest.mark.parametrize("name", CASES)
def test_a_bias_free_model_is_todays_with_zero_biases_to_the_bit(name):
    with_bias, without = randomised_pair(name)
    src, tgt = batch()
    outs = []
    for model in (with_bias, without):
        torch.manual_seed(3)  # the same dropout masks (dropout 0.1 on residuals, attention and FFN)
        out = model.train()(src, tgt)
        out.square().mean().backward()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    names = dict(with_bias.named_parameters())
    for n, p in without.named_parameters():
        assert torch.equal(p.grad, names[n].grad), n
    # the comparison can fail: a bias away from 0 changes the output (an out_proj's: a k_proj's
    # would shift every logit of a query alike, which softmax ignores up to rounding)
    with torch.no_grad():
        names[min(n for n in removable(with_bias) if n.endswith("out_proj.bias"))].fill_(0.1)
    torch.manual_seed(3)
    assert not torch.equal(with_bias(src, tgt), outs[0])


@pytest.mark.parametrize("name", ["pre", "post", "qk_l2", "value_residual", "hybrid", "hyper_dynamic", "dlcl_pre"])
def test_cached_decoding_equals_full_decoding_without_biases(name):
    torch.manual_seed(2)
    model = Seq2SeqTransformer(tiny(bias=False, **{**CASES[name][0], "dropout": 0.0})).eval()
    assert removable(model) & set(dict(model.named_parameters())) == set()
    g = torch.Generator().manual_seed(4)
    src, tgt = torch.randint(3, V, (6, 6), generator=g), torch.randint(3, V, (6, 6), generator=g)
    src[0, 4:] = PAD
    check_cached_decoding(model, src, tgt)


def test_layerdrop_drophead_and_pruning_keep_a_model_bias_free(tmp_path):
    """The structured regularizers compose: a bias-free model with LayerDrop and DropHead trains, and
    its pruned copy is rebuilt bias-free from its saved ModelConfig (a strict load) and computes the same."""
    from normlab.checkpoint import load_model, save_model
    from normlab.regularizers.pruning import prune

    torch.manual_seed(0)
    reg = {"encoder_layerdrop": 0.2, "decoder_layerdrop": 0.2, "drophead": 0.2}
    model = Seq2SeqTransformer(tiny(bias=False, norm=PRE, regularizer=reg))
    src, tgt = batch()
    model.train()(src, tgt).square().mean().backward()
    pruned = prune(model, [1], [0, 2]).eval()
    loaded, _ = load_model(save_model(tmp_path / "p.ckpt", pruned, tokenizer_proto=None))
    assert loaded.cfg.bias is False and loaded.cfg.encoder_layers == 1
    assert removable(loaded) & set(dict(loaded.named_parameters())) == set()
    assert torch.equal(loaded(src, tgt), pruned(src, tgt))


def test_admin_profiles_and_exports_a_bias_free_model():
    """Admin's ω (Liu et al. 2020) profiled on the bias-free model is today's at the same seed (its
    biases start at 0), and the export to plain post-norm folds ω into norms without β, exactly."""
    with_bias, without = paired("admin")
    src, tgt = batch(5)
    reports = [profile_omega_(m, [{"src": src, "tgt_in": tgt}], PAD) for m in (with_bias, without)]
    assert reports[0] == reports[1]
    with torch.no_grad():  # a trained ω: a vector, each stack's first block's 1 (what export needs to be exact)
        for i, (_, block) in enumerate(without.residual_blocks()):
            block.omega.uniform_(0.5, 2.0)
            if i in (0, 2 * LE):
                block.omega.fill_(1.0)
    plain, report = export_post_norm(without.eval())
    assert report == {"exact": True, "inexact": {}} and not plain.cfg.bias
    assert set(dict(plain.named_parameters())) == {n for n in dict(without.named_parameters()) if "omega" not in n}
    torch.testing.assert_close(plain.eval()(src, tgt), without(src, tgt), rtol=1e-4, atol=1e-4)


def test_a_config_from_before_the_key_keeps_its_biases():
    # an old checkpoint's model_config has no `bias`: it rebuilds today's model and loads strictly
    old = {k: v for k, v in tiny(norm=PRE).to_dict().items() if k != "bias"}
    model = Seq2SeqTransformer.from_config_dict(old)
    assert model.cfg.bias is True
    model.load_state_dict(paired("pre")[0].state_dict())


@pytest.mark.parametrize("value", ["false", 0, None])
def test_bias_is_a_bool(value):
    line = f"model.bias: {value!r} is not valid (allowed: true, false)"
    with pytest.raises(ConfigError, match=f"^{re.escape(line)}$"):
        tiny(bias=value)


@pytest.mark.integration
def test_a_bad_value_on_the_command_line_is_one_line(tmp_path, monkeypatch, capsys):
    from normlab.commands.train import main as train_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("NORMLAB_TRACEBACK", raising=False)
    assert train_main(["model.bias=maybe", "logger=csv"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["error: model.bias: 'maybe' is not valid (allowed: true, false)"]


@pytest.mark.integration
def test_a_two_step_run_without_biases(small_corpus, tmp_path):
    import json

    from normlab.checkpoint import load_model, resolve_checkpoint
    from normlab.train import run

    from conftest import compose_cfg, tiny_overrides

    run_dir = tmp_path / "run"
    cfg = compose_cfg(tiny_overrides(small_corpus, run_dir, tmp_path / "cache")
                      + ["model.bias=false", "trainer.max_steps=2", "eval.test=false"])
    run(cfg)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and results["steps"] == 2
    model, _ = load_model(resolve_checkpoint(run_dir))
    names = set(dict(model.named_parameters()))
    assert model.cfg.bias is False and removable(model) & names == set()
    assert "encoder.layers.0.ffn.sublayer.fc1.bias" in names
