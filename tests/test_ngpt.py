"""The normalized Transformer (nGPT, Loshchilov et al. 2025, arXiv 2410.01131), norm.placement=ngpt: one
encoder and one decoder layer (cross-attention included) against a plain float64 computation of the
paper's equations with hand-set weights and scales, the stack's input and logits, unit hidden states,
unit-norm matrices at init and after a step, cached decoding equal to full, the parameter groups,
and the combinations refused (the 2-step run: test_norm_runs.py)."""
import math

import pytest
import torch
from torch import nn

from normlab.config import ConfigError, ModelConfig
from normlab.model.ngpt import ALPHA_INIT, NGPTFeedForward, ScaledVector
from normlab.model.residual import ResidualBlock
from normlab.model.transformer import Seq2SeqTransformer
from normlab.optimizers import parameter_groups

from conftest import cached_and_full
from test_arms import PAD, V, batch, tiny

NGPT = dict(norm={"type": "none", "placement": "ngpt"}, bias=False)
D = 16


def built(seed=0, **kw) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    return Seq2SeqTransformer(tiny(**{**NGPT, **kw})).eval().double()


def unit(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True))


def hand_set_(model, seed=7):
    # every weight and scale away from its init: plain normal draws (not unit rows: the equations hold
    # for any weights), the scaled vectors' stored s_p positive and varied
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".s"):
                p.copy_(p * (0.5 + torch.rand(p.shape, generator=g, dtype=p.dtype)))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def eff(vec: ScaledVector, init, scale):
    # s = s_p · s_init / s_scale with the paper's constants, written out
    return vec.s.detach() * init / scale


def attention(x, mem, attn, heads, mask):
    # §2.3: q, k per head to unit norm, times s_qk; logits √d_k·q·k; softmax; merge heads; W_o
    B, T, _ = x.shape
    dk = D // heads
    s_qk = eff(attn.qk_norm.s_qk, 1.0, D ** -0.5).view(heads, 1, dk)
    split = lambda t: t.view(B, -1, heads, dk).transpose(1, 2)  # noqa: E731
    q = s_qk * unit(split(x @ attn.q_proj.weight.T))
    k = s_qk * unit(split(mem @ attn.k_proj.weight.T))
    v = split(mem @ attn.v_proj.weight.T)
    logits = math.sqrt(dk) * q @ k.transpose(-1, -2)
    a = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    return (a @ v).transpose(1, 2).reshape(B, T, D) @ attn.out_proj.weight.T


def ffn(x, f: NGPTFeedForward):
    # §2.4 with our ReLU FFN: u = s_u ⊙ W_1 h, W_2 ReLU(u)
    return torch.relu(eff(f.s_u, 1.0, 1.0) * (x @ f.fc1.weight.T)) @ f.fc2.weight.T


def step(h, branch, block):
    # h ← Norm(h + α ⊙ (Norm(F(h)) − h)), α = α_p · α_init / (1/√d)
    alpha = eff(block.ngpt_alpha, ALPHA_INIT, D ** -0.5)
    return unit(h + alpha * (unit(branch) - h))


def test_an_encoder_and_a_decoder_layer_are_the_papers_equations():
    model = built()
    hand_set_(model)
    src, tgt = batch()
    pad = src.eq(PAD)
    g = torch.Generator().manual_seed(3)
    x = unit(torch.randn(3, 7, D, generator=g, dtype=torch.float64))
    enc = model.encoder.layers[0]
    keys = (~pad)[:, None, None, :]
    h = step(x, attention(x, x, enc.self_attn.sublayer, 2, keys), enc.self_attn)
    h = step(h, ffn(h, enc.ffn.sublayer), enc.ffn)
    torch.testing.assert_close(enc(x, pad), h, rtol=1e-12, atol=1e-12)

    y = unit(torch.randn(3, 5, D, generator=g, dtype=torch.float64))
    dec = model.decoder.layers[1]
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    h = step(y, attention(y, y, dec.self_attn.sublayer, 2, causal), dec.self_attn)
    h = step(h, attention(h, x, dec.cross_attn.sublayer, 2, keys), dec.cross_attn)  # memory x
    h = step(h, ffn(h, dec.ffn.sublayer), dec.ffn)
    torch.testing.assert_close(dec(y, x, pad), h, rtol=1e-12, atol=1e-12)


def test_the_stacks_start_on_the_sphere_end_without_a_norm_and_scale_the_logits():
    model = built()
    hand_set_(model)
    src, tgt = batch()
    pad = src.eq(PAD)
    E = model.encoder.embed.tokens.weight.detach()
    pe = model.encoder.embed.positions.table.double()
    h = unit(math.sqrt(D) * E[src] + pe[:7])  # h₀ = Norm(√d·e + PE)
    for layer in model.encoder.layers:
        h = layer(h, pad)
    memory, _ = model.encode(src)
    torch.testing.assert_close(memory, h, rtol=1e-12, atol=1e-12)
    y = unit(math.sqrt(D) * E[tgt] + pe[:5])
    for layer in model.decoder.layers:
        y = layer(y, memory, pad)
    s_z = eff(model.output_projection.logit_scale, 1.0, D ** -0.5)
    torch.testing.assert_close(model(src, tgt), s_z * (y @ E.T), rtol=1e-12, atol=1e-12)  # z = s_z ⊙ E h


def test_scales_start_at_the_papers_init_stored_at_their_scale():
    model = built()
    blocks = [b for _, b in model.residual_blocks()]
    assert len(blocks) == 3 * 2 + 2 * 3
    for b in blocks:  # α: stored 1/√d, used 0.05
        assert torch.equal(b.ngpt_alpha.s.detach(), torch.full((D,), D ** -0.5, dtype=torch.float64))
        torch.testing.assert_close(b.ngpt_alpha(), torch.full((D,), 0.05, dtype=torch.float64))
    attn = model.decoder.layers[0].cross_attn.sublayer
    torch.testing.assert_close(attn.qk_norm.s_qk(), torch.ones(D, dtype=torch.float64))
    assert attn.qk_norm.sdpa_scale == math.sqrt(D // 2)
    torch.testing.assert_close(model.output_projection.logit_scale(), torch.ones(V, dtype=torch.float64))
    assert torch.equal(model.encoder.layers[0].ffn.sublayer.s_u.s.detach(), torch.ones(24, dtype=torch.float64))


def matrices(model):
    # (name, weight, the axis of length d_model that is normalised)
    for name, m in model.named_modules():
        if hasattr(m, "q_proj"):
            for p in ("q_proj", "k_proj", "v_proj"):
                yield f"{name}.{p}", getattr(m, p).weight, 1
            yield f"{name}.out_proj", m.out_proj.weight, 0
        elif isinstance(m, NGPTFeedForward):
            yield f"{name}.fc1", m.fc1.weight, 1
            yield f"{name}.fc2", m.fc2.weight, 0
    yield "embedding", model.encoder.embed.tokens.weight[PAD + 1:], 1  # the pad row is 0 and stays 0


def assert_unit(model):
    for name, w, axis in matrices(model):
        torch.testing.assert_close(w.detach().norm(dim=axis), torch.ones(w.shape[1 - axis], dtype=w.dtype),
                                   msg=name)


def test_every_matrix_is_unit_norm_along_its_embedding_axis_at_init_and_after_a_step():
    model = built(tie_output_embeddings=False).train()
    assert_unit(model)
    assert model.encoder.embed.tokens.weight[PAD].eq(0).all()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    src, tgt = batch()
    model(src, tgt).logsumexp(-1).mean().backward()
    opt.step()
    with pytest.raises(AssertionError):  # the step leaves the sphere ...
        assert_unit(model)
    model.constrain_()
    assert_unit(model)  # ... and the constraint brings every matrix back
    untied = model.output_projection.untied.weight.detach()
    torch.testing.assert_close(untied.norm(dim=1), torch.ones(V, dtype=torch.float64))


def test_every_hidden_state_is_a_unit_vector():
    model = built()
    hand_set_(model)
    model.constrain_()
    outputs = []
    hooks = [b.register_forward_hook(lambda m, i, o: outputs.append(o)) for b in model.modules()
             if isinstance(b, ResidualBlock)]
    hooks += [s.stream_in.register_forward_hook(lambda m, i, o: outputs.append(o))
              for s in (model.encoder, model.decoder)]
    src, tgt = batch()
    model(src, tgt)
    for h in hooks:
        h.remove()
    assert len(outputs) == 12 + 2
    for o in outputs:
        torch.testing.assert_close(o.norm(dim=-1), torch.ones(o.shape[:-1], dtype=o.dtype))


def test_cached_decoding_equals_full():
    model = built()
    hand_set_(model, seed=2)
    model.constrain_()
    steps, full = cached_and_full(model, *batch(1))
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)


def test_the_scales_are_the_scheme_group_and_the_matrices_have_no_bias():
    model = built()
    groups = parameter_groups(model)
    scheme = [n for n, _ in groups["scheme"]]
    assert scheme and all(n.endswith(".s") for n in scheme) and not groups["biases"] and not groups["gains"]
    assert len([n for n in scheme if "ngpt_alpha" in n]) == 12
    assert "output_projection.logit_scale.s" in scheme


@pytest.mark.parametrize("kw, message", [
    (dict(norm={"type": "layernorm", "placement": "ngpt"}),
     r"^norm\.type: layernorm with norm\.placement=ngpt: nGPT removes every norm layer"),
    (dict(norm={"type": "none", "placement": "ngpt", "fixnorm": True}), r"^norm\.fixnorm: true with norm\.placement=ngpt"),
    (dict(bias=True), r"^model\.bias: true with norm\.placement=ngpt: nGPT's projections have no biases"),
    (dict(qk_norm="l2"), r"^model\.qk_norm: l2 with norm\.placement=ngpt: nGPT normalises"),
    (dict(k_norm=True), r"^model\.k_norm: True with norm\.placement=ngpt"),
    (dict(residual="hyper"), r"^model\.residual: hyper with norm\.placement=ngpt: "),
    (dict(layer_aggregation="dlcl"), r"^model\.layer_aggregation: dlcl with norm\.placement=ngpt: nGPT keeps"),
    (dict(layer_aggregation="dwa"), r"^model\.layer_aggregation: dwa with norm\.placement=ngpt: nGPT keeps"),
    (dict(layer_aggregation="attnres"), r"^model\.layer_aggregation: attnres with norm\.placement=ngpt: "),
    (dict(init="admin"), r"^init: admin with norm\.placement=ngpt: "),
])
def test_ngpt_refuses_what_it_replaces(kw, message):
    with pytest.raises(ConfigError, match=message):
        tiny(**{**NGPT, **kw})


def test_none_is_refused_with_other_placements_naming_both():
    with pytest.raises(ConfigError, match=r"^norm\.type: none with norm\.placement=pre: .*rezero or ngpt$"):
        ModelConfig(norm={"type": "none", "placement": "pre"})


def test_warmup_and_weight_decay_are_applied_with_a_warning(caplog):
    # the paper trains without either (§2.6); the arm sets both to 0; other values are applied (a study
    # may screen the warmup per arm) and the run log says so, once per fit
    from normlab.lit_module import Seq2SeqModule
    from normlab.run_config import validate_run_config
    from normlab.settings import EvalSpec, OptimSpec

    from conftest import compose_cfg

    validate_run_config(compose_cfg(["logger=csv", "+arm=ngpt", "optim.warmup=150", "optim.weight_decay=0.1"]))
    cfg = tiny(**NGPT).to_dict()
    with caplog.at_level("WARNING", logger="normlab"):
        Seq2SeqModule(cfg, optim=OptimSpec(warmup=0), eval=EvalSpec()).configure_optimizers()
    assert not caplog.records
    with caplog.at_level("WARNING", logger="normlab"):
        Seq2SeqModule(cfg, optim=OptimSpec(warmup=150, weight_decay=0.1), eval=EvalSpec()).configure_optimizers()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "optim.warmup=150 with norm.placement=ngpt", "optim.weight_decay=0.1 with norm.placement=ngpt"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="normlab"):  # inverse_sqrt_hold: `warmup` is a hold at the peak, no ramp
        Seq2SeqModule(cfg, optim=OptimSpec(warmup=200, schedule="inverse_sqrt_hold"), eval=EvalSpec()).configure_optimizers()
    assert not caplog.records
    with caplog.at_level("WARNING", logger="normlab"):  # the other schemes: nothing said
        Seq2SeqModule(tiny().to_dict(), optim=OptimSpec(warmup=150, weight_decay=0.1), eval=EvalSpec()).configure_optimizers()
    assert not caplog.records


def test_ngpt_composes_with_the_attention_options_and_layerdrop():
    model = built(attn_gate="headwise", attn_sink=True, value_residual=True, logit_softcap=30.0,
                  regularizer={"encoder_layerdrop": 0.2})
    src, tgt = batch()
    assert model(src, tgt).isfinite().all()
    assert isinstance(model.encoder.layers[0].self_attn.sublayer.stability.gate, nn.Module)


def test_the_arm_names_the_run():
    from normlab import identity

    from conftest import compose_cfg

    labels = identity.labels(compose_cfg(["logger=csv", "+arm=ngpt"]))
    assert (labels["norm"], labels["arm"]) == ("ngpt", "ngpt+nobias")


def test_both_schemes_are_in_the_docs_table_with_their_papers():
    from conftest import ROOT

    rows = [line for line in (ROOT / "docs" / "schemes.md").read_text(encoding="utf-8").split("\n")
            if line.startswith("| `")]
    for key, paper in (("norm.placement=ngpt", "arXiv 2410.01131"), ("model.layer_aggregation=attnres", "arXiv 2603.15031")):
        mine = [row for row in rows if row.startswith(f"| `{key}`")]
        assert len(mine) == 1 and paper in mine[0], key
    assert "`model.attnres_block=S`" in [row for row in rows if "attnres" in row][0]


@pytest.mark.parametrize("kw", [NGPT, dict(norm={"placement": "pre"}, layer_aggregation="attnres", attnres_block=2)],
                         ids=["ngpt", "attnres"])
def test_bf16_autocast_keeps_the_unit_sphere_and_the_depth_softmax_in_fp32(kw):
    # under autocast the norms and AttnRes's logits and softmax run in fp32 (norms.widened) and round once
    torch.manual_seed(0)
    model = Seq2SeqTransformer(tiny(**kw)).eval()
    src, tgt = batch()
    full = model(src, tgt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = model(src, tgt)
        memory, _ = model.encode(src)
    torch.testing.assert_close(half.float(), full, atol=0.1, rtol=0.05)
    if kw is NGPT:
        torch.testing.assert_close(memory.float().norm(dim=-1), torch.ones(memory.shape[:-1]), atol=1e-2, rtol=0)


@pytest.mark.parametrize("kw", [dict(NGPT, tie_output_embeddings=False), dict(norm={"placement": "pre"})],
                         ids=["ngpt", "pre"])
def test_averaged_checkpoints_are_back_on_the_sphere_and_other_schemes_are_the_plain_mean(kw, tmp_path, monkeypatch):
    # nGPT's matrices have unit rows (Loshchilov et al. 2025); the mean of two different unit rows is
    # shorter than 1. The final test's averaged pass and the average command both evaluate the
    # renormalised mean; a pre-LN model's average is the element-wise mean, bit for bit.
    from normlab import final_test
    from normlab.checkpoint import load_checkpoint, load_model, save_model
    from normlab.commands import average
    from normlab.commands.common import main_guard

    (tmp_path / "checkpoints").mkdir()
    paths, states = [], []
    for i in (1, 2):
        torch.manual_seed(i)
        model = Seq2SeqTransformer(tiny(**kw))
        hand_set_(model, seed=i)
        model.constrain_()
        paths.append(save_model(tmp_path / "checkpoints" / f"step{2 * i}.ckpt", model))
        states.append(load_checkpoint(paths[-1])["state_dict"])
    mean = {k: ((states[0][k].double() + states[1][k].double()) / 2).to(v.dtype) for k, v in states[0].items()}
    seen = []
    monkeypatch.setattr(final_test, "evaluation_pass", lambda out, trainer, module, dm, split, ckpt, **_: seen.append(ckpt))
    trainer = type("T", (), {"is_global_zero": True, "strategy": type("S", (), {"barrier": lambda self: None})()})()
    rng = torch.get_rng_state()
    final_test._averaged_test(trainer, None, None, tmp_path, 2)
    assert torch.equal(torch.get_rng_state(), rng)  # building the model to renormalise draws no random numbers of the run's
    assert main_guard(average.main, [str(p) for p in paths] + ["--output", str(tmp_path / "avg.ckpt")]) == 0
    for path in (seen[0], tmp_path / "avg.ckpt"):
        evaluated = load_model(path)[0]
        if kw["norm"]["placement"] == "ngpt":
            plain = Seq2SeqTransformer(tiny(**kw))
            plain.load_state_dict({k[len("model."):]: v for k, v in mean.items()})
            norms = [w.detach().norm(dim=axis) for _, w, axis in matrices(plain)]
            assert all(n.lt(1 - 1e-3).any() for n in norms)  # the plain mean is off the sphere
            assert_unit(evaluated)
            untied = evaluated.output_projection.untied.weight.detach()
            torch.testing.assert_close(untied.norm(dim=1), torch.ones(V))
        else:
            got = load_checkpoint(path)["state_dict"]
            assert got.keys() == mean.keys() and all(torch.equal(got[k], mean[k]) for k in mean)
