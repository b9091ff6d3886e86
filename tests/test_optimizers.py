"""optim.optimizer (src/normlab/optimizers.py, issue 38): Adam as every run before, and AdamW with
decoupled weight decay on named parameter groups, checked against the first step's closed form."""
import json

import pytest
import torch
from torch import nn

from normlab import identity
from normlab.config import ConfigError, ModelConfig, NormConfig
from normlab.model.transformer import Seq2SeqTransformer
from normlab.optimizers import GROUPS, build_optimizer, parameter_groups
from normlab.settings import OptimSpec

from conftest import compose_cfg, tiny_overrides

BASE = dict(vocab_size=23, d_model=16, encoder_layers=2, decoder_layers=2, encoder_heads=2, decoder_heads=2,
            encoder_ffn=24, decoder_ffn=20, max_positions=64)
LR, WD, EPS = 0.01, 0.1, 1e-9


def model(**kw) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(ModelConfig(**BASE, **kw)).double()


def test_every_parameter_is_in_one_group_by_its_role():
    for kw in ({}, {"norm": NormConfig(placement="rezero", type="none")}):
        m = model(**kw)
        groups = parameter_groups(m)
        names = [n for members in groups.values() for n, _ in members]
        assert sorted(names) == sorted(n for n, _ in m.named_parameters())  # each once (tied tensors once)
        linear = {id(x.weight) for x in m.modules() if isinstance(x, nn.Linear)}
        assert {id(p) for _, p in groups["matrices"]} == linear - {id(x.weight) for x in m.modules()
                                                                   if isinstance(x, nn.Embedding)}
        assert all(n.endswith(".bias") for n, _ in groups["biases"]) and groups["biases"]
        assert [n for n, _ in groups["embeddings"]] == ["encoder.embed.tokens.embedding.weight"]  # shared, tied
    ln = parameter_groups(model())
    assert ln["gains"] and all(n.endswith(".weight") for n, _ in ln["gains"]) and not ln["scheme"]
    rezero = parameter_groups(model(norm=NormConfig(placement="rezero", type="none")))
    assert not rezero["gains"] and {n.rsplit(".", 1)[-1] for n, _ in rezero["scheme"]} == {"scale"}  # ReZero's α
    assert len(rezero["scheme"]) == 2 * 2 + 2 * 3  # a residual's α per sub-layer (decoder: self, cross, FFN)


def _one_step(spec: OptimSpec):
    m = model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    g = torch.Generator().manual_seed(1)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    opt = build_optimizer(m, spec, LR, {"foreach": True})
    opt.step()
    return m, opt, before, grads


def test_adamw_decays_the_matrices_alone_decoupled_from_the_gradient():
    """Adam's first step is lr·g/(|g| + eps) (m̂ = g, v̂ = g²); AdamW multiplies p by 1 - lr·wd first
    (Loshchilov & Hutter 2019, Algorithm 2, line 12) in the decayed groups only."""
    m, opt, before, grads = _one_step(OptimSpec(optimizer="adamw", weight_decay=WD))
    assert isinstance(opt, torch.optim.AdamW)
    assert {grp["group"]: grp["weight_decay"] for grp in opt.param_groups} == {
        "matrices": WD, "embeddings": 0.0, "gains": 0.0, "biases": 0.0}
    decayed = {n for n, _ in parameter_groups(m)["matrices"]}
    for n, p in m.named_parameters():
        g, p0 = grads[n], before[n]
        expected = p0 * (1 - LR * WD if n in decayed else 1.0) - LR * g / (g.abs() + EPS)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12, msg=n)


def test_no_decay_names_the_groups_left_undecayed():
    _, opt, _, _ = _one_step(OptimSpec(optimizer="adamw", weight_decay=WD, no_decay=["embeddings", "biases"]))
    assert {grp["group"]: grp["weight_decay"] for grp in opt.param_groups} == {
        "matrices": WD, "embeddings": 0.0, "gains": WD, "biases": 0.0}


def test_adam_stays_the_coupled_l2_on_every_parameter_in_one_group():
    """optimizer=adam (the default) is today's Adam: one group, model.parameters() in order, the decay
    added to the gradient (g + wd·p) of every parameter."""
    m, opt, before, grads = _one_step(OptimSpec(weight_decay=WD))
    assert type(opt) is torch.optim.Adam and len(opt.param_groups) == 1
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in m.parameters()]
    for n, p in m.named_parameters():
        g = grads[n] + WD * before[n]
        torch.testing.assert_close(p.detach(), before[n] - LR * g / (g.abs() + EPS), rtol=1e-12, atol=1e-12, msg=n)


def test_the_run_log_lists_each_groups_members(caplog):
    m = model()
    with caplog.at_level("INFO", logger="normlab"):
        build_optimizer(m, OptimSpec(optimizer="adamw", weight_decay=WD), LR, {})
    lines = [r.getMessage() for r in caplog.records]
    assert [ln.split(":")[0] for ln in lines] == [f"optim adamw group {g}" for g in GROUPS if g != "scheme"]
    matrices = parameter_groups(m)["matrices"]
    assert lines[0] == (f"optim adamw group matrices: weight_decay 0.1, {len(matrices)} tensors, "
                        f"{sum(p.numel() for _, p in matrices):,} parameters: " + ", ".join(n for n, _ in matrices))


@pytest.mark.parametrize("values, key", [({"optimizer": "sgd"}, "optim.optimizer"),
                                         ({"optimizer": "adamw", "no_decay": ["matrices"]}, "optim.no_decay"),
                                         ({"optimizer": "adamw", "no_decay": "gains"}, "optim.no_decay"),
                                         # one set of groups, one order: one run name
                                         ({"optimizer": "adamw", "no_decay": ["gains", "embeddings"]}, "optim.no_decay"),
                                         ({"optimizer": "adamw", "no_decay": ["biases", "biases"]}, "optim.no_decay"),
                                         # read by adamw alone: it would rename an Adam run that it does not change
                                         ({"no_decay": ["biases"]}, "optim.no_decay"),
                                         ({"z_loss": -1e-4}, "optim.z_loss")])
def test_a_bad_optimizer_setting_is_refused_by_its_key(values, key):
    with pytest.raises(ConfigError) as e:
        OptimSpec.of(values).validate()
    assert str(e.value).startswith(f"{key}: ") and "allowed" in str(e.value)


def test_adamw_names_a_new_run_and_the_default_names_none(tmp_path):
    base = ["model.d_model=32"]
    h = identity.identity_hash
    assert h(compose_cfg(base + ["optim.optimizer=adam"])) == h(compose_cfg(base))  # neutral: old runs found
    assert h(compose_cfg(base + ["optim=adamw"])) != h(compose_cfg(base))
    assert h(compose_cfg(base + ["optim=adamw", "optim.no_decay=[embeddings,biases,scheme]"])) != h(
        compose_cfg(base + ["optim=adamw"]))


@pytest.mark.integration
def test_a_two_step_adamw_run_trains_and_logs_its_groups(small_corpus, tmp_path, caplog):
    from normlab.train import run

    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache")
                      + ["optim=adamw", "trainer.max_steps=2", "eval.valid_bleu=false", "eval.test=false"])
    with caplog.at_level("INFO", logger="normlab"):
        results = run(cfg)
    assert results["status"] == "completed" and results["steps"] == 2
    log = caplog.text  # the run log's lines (train.log under the command, the same logger)
    assert "optim adamw group matrices: weight_decay 0.1, " in log and "optim adamw group gains: weight_decay 0, " in log
    assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "completed"


def _clip_run(small_corpus, tmp_path, name, clip):
    import csv

    from normlab.train import run

    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / name, tmp_path / "cache")
                      + [f"optim.clip_norm={clip}", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
                         "trainer.val_check_interval=4", "eval.valid_bleu=false", "eval.test=false"])
    assert run(cfg)["status"] == "completed"
    rows = list(csv.DictReader(open(tmp_path / name / "csv" / "metrics.csv")))
    return [r["train/loss"] for r in rows if r.get("train/loss")], [r.get("train/clip_rate") for r in rows
                                                                      if r.get("train/clip_rate")]


@pytest.mark.integration
def test_the_clip_rate_is_logged_and_clipping_is_lightnings_own(small_corpus, tmp_path, monkeypatch):
    """train/clip_rate: the share of updates whose gradient norm exceeded optim.clip_norm (every one at a
    limit of 1e-9, none at 1e9); the losses equal those of Lightning's own configure_gradient_clipping."""
    import lightning as L

    from normlab.lit_module import Seq2SeqModule

    losses, rates = _clip_run(small_corpus, tmp_path, "tight", 1e-9)
    assert len(losses) == 4 and [float(r) for r in rates] == [1.0] * 4
    assert [float(r) for r in _clip_run(small_corpus, tmp_path, "loose", 1e9)[1]] == [0.0] * 4
    monkeypatch.setattr(Seq2SeqModule, "configure_gradient_clipping", L.LightningModule.configure_gradient_clipping)
    plain_losses, plain_rates = _clip_run(small_corpus, tmp_path, "lightning", 1e-9)
    assert plain_losses == losses and plain_rates == []  # the same updates, bit for bit (the CSV's digits)


@pytest.mark.parametrize("z", [0.0, 1e-4, 0.3])
def test_z_loss_and_its_gradient_are_palms_formula(z):
    """optim.z_loss: the objective adds z·Σ log²Z over non-pad targets (Chowdhery et al. 2022, PaLM,
    section 5: z_loss = 1e-4 · log² Z); the chunked loss's value and gradients equal autograd's through
    the plain formula on full logits (fp64, several chunks); z = 0 is the smoothed loss itself."""
    from normlab import losses

    g = torch.Generator().manual_seed(3)
    N, D, V, PAD = 37, 8, 29, 0
    x = torch.randn(N, D, generator=g, dtype=torch.float64) * 3
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    target = torch.randint(1, V, (N,), generator=g)
    target[::5] = PAD
    keep = target.ne(PAD).double()
    old = losses.CHUNK_ELEMENTS["cpu"]
    losses.CHUNK_ELEMENTS["cpu"] = 4 * V  # 4 rows a chunk: the sums cross chunks
    try:
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        objective, nll, log_z2 = losses.projected_label_smoothed_nll(xa, wa, target, 0.1, PAD, "uniform", z)
        objective.backward()
    finally:
        losses.CHUNK_ELEMENTS["cpu"] = old
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = xr @ wr.t()
    lprobs = logits.log_softmax(-1)
    smoothed = -(0.9 * lprobs.gather(1, target[:, None]).squeeze(1) + 0.1 / V * lprobs.sum(-1))
    lse = torch.logsumexp(logits, -1)
    reference = (smoothed * keep).sum() + z * (lse.square() * keep).sum()
    reference.backward()
    torch.testing.assert_close(objective, reference, rtol=1e-12, atol=1e-10)
    expected_z2 = (lse.square() * keep).sum().detach() if z else torch.zeros((), dtype=torch.float64)  # not computed
    torch.testing.assert_close(log_z2, expected_z2, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(wa.grad, wr.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.integration
def test_a_z_loss_run_logs_its_part(small_corpus, tmp_path):
    import csv

    from normlab.train import run

    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache")
                      + ["optim.z_loss=1e-4", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
                         "eval.valid_bleu=false", "eval.test=false"])
    assert run(cfg)["status"] == "completed"
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")) if r.get("train/z_loss")]
    # log Z of a near-uniform softmax over the 300-word vocabulary is about log 300 = 5.7: z·log²Z ≈ 3.3e-3
    assert len(rows) == 2 and all(1e-3 < float(r["train/z_loss"]) < 1e-2 for r in rows)


@pytest.mark.integration
def test_resume_under_another_optimizer_or_groups_is_one_line(small_corpus, tmp_path):
    """resume= restores the optimizer state with its groups and their decay: another optim.optimizer or
    optim.no_decay is refused by its key before any work (finetune= starts the optimizer afresh)."""
    from normlab.train import run

    def tiny(name, *extra):
        return tiny_overrides(small_corpus, tmp_path / name, tmp_path / "cache") + [
            "trainer.max_steps=2", "eval.valid_bleu=false", "eval.test=false", *extra]

    assert run(compose_cfg(tiny("adam")))["status"] == "completed"
    assert run(compose_cfg(tiny("adamw", "optim=adamw")))["status"] == "completed"
    cases = [("adam", ["optim=adamw"], "optim.optimizer: 'adamw': resume={} trained with 'adam'"),
             ("adamw", ["optim=adamw", "optim.no_decay=[embeddings]"],
              "optim.no_decay: ['embeddings']: resume={} trained with ['embeddings', 'gains', 'biases', 'scheme']")]
    for i, (name, extra, line) in enumerate(cases):
        start = tmp_path / name / "checkpoints" / "last.ckpt"
        with pytest.raises(ConfigError) as e:
            run(compose_cfg(tiny(f"resumed{i}", *extra, f"resume={start}", "trainer.max_steps=4")))
        assert str(e.value).startswith(line.format(start)), str(e.value)
        assert not (tmp_path / f"resumed{i}" / "checkpoints").exists()  # refused before any work
