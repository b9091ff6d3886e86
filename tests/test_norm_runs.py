"""Tiny runs of the normalization-study features: init=admin end to end (ω profiled before step 1,
saved, exported), and divergence turned into a result."""
import json
import math

import pytest
import torch

from normlab.checkpoint import load_checkpoint, load_model
from normlab.commands.common import main_guard
from normlab.commands.export_admin import main as export_main
from normlab.lit_module import Seq2SeqModule
from normlab.callbacks import instantiate_callbacks
from normlab.config import ConfigError
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

FAST = ["eval.valid_bleu=false", "eval.test=false"]  # no decoding: these tests are about training


def overrides(small_corpus, tmp_path_factory, *extra):
    run_dir = tmp_path_factory.mktemp("run")
    return run_dir, tiny_overrides(small_corpus, run_dir, tmp_path_factory.getbasetemp() / "cache") + FAST + list(extra)


@pytest.fixture(scope="module")
def admin_run(small_corpus, tmp_path_factory):
    run_dir, ov = overrides(small_corpus, tmp_path_factory, "norm=postnorm", "init=admin", "init.admin.batches=2",
                            "callbacks.diagnostics.every_n_steps=4")
    return run_dir, run(compose_cfg(ov))


def test_admin_run_profiles_omega_before_step_one_and_saves_it(admin_run):
    run_dir, results = admin_run
    assert results["status"] == "completed" and results["steps"] == 8
    saved = json.loads((run_dir / "admin_omega.json").read_text())
    assert saved["mode"] == "profile" and saved["batches"] == 2
    omega = saved["omega"]
    assert len(omega) == 2 * 2 + 2 * 3
    assert omega["enc.0.self_attn"] == omega["dec.0.self_attn"] == 1.0
    assert 1.0 < omega["enc.0.ffn"] < omega["enc.1.self_attn"] < omega["enc.1.ffn"]
    # ω is a parameter: in the checkpoint, trained away from (but near) the profiled value
    state = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    trained = state["model.encoder.layers.1.ffn.omega"]
    assert trained.shape == (32,)
    assert not torch.allclose(trained, torch.full((32,), omega["enc.1.ffn"]))
    assert (trained - omega["enc.1.ffn"]).abs().max() < 0.1


def test_diagnostics_logged_every_k_steps(admin_run):
    import csv

    run_dir, _ = admin_run
    rows = [r for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("diag/enc.0.ffn/ratio")]
    assert [int(r["step"]) for r in rows] == [0, 4]
    for r in rows:
        for name in ("enc.1.self_attn", "dec.1.cross_attn"):
            assert 0 < float(r[f"diag/{name}/ratio"]) < 100
            assert float(r[f"diag/{name}/grad_norm"]) > 0
            assert float(r[f"diag/{name}/omega_min"]) <= float(r[f"diag/{name}/omega_max"])
        assert float(r["diag/output_change/decoder"]) > 0
    # step 0 sees the profiled ω, before any update
    profiled = json.loads((run_dir / "admin_omega.json").read_text())["omega"]["enc.1.ffn"]
    assert float(rows[0]["diag/enc.1.ffn/omega_mean"]) == pytest.approx(profiled, rel=1e-6)


def test_export_cli_on_a_trained_admin_checkpoint(admin_run, tmp_path, capsys):
    run_dir, _ = admin_run
    out = tmp_path / "plain.ckpt"
    # trained ω_1 != 1: not exact, so refused with the reason ...
    assert main_guard(export_main, [str(run_dir), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir}: ") and err.count("\n") == 1 and "first sub-layer" in err
    assert not out.exists()
    # ... unless asked for the approximation, which loads as a plain post-norm model
    assert export_main([str(run_dir), str(out), "--allow-inexact"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["inexact"]) == {"enc.0.self_attn", "dec.0.self_attn"}
    model, tok = load_model(out)
    assert model.cfg.init == "xavier" and tok is not None
    assert not any(n.endswith("omega") for n, _ in model.named_parameters())
    assert load_checkpoint(out)["admin_export"]["max_abs_logit_diff"] == pytest.approx(report["max_abs_logit_diff"])


def test_admin_options_compose(small_corpus, tmp_path):
    cfg = compose_cfg(["norm=postnorm", "init=admin", "init.admin.mode=closed_form", "logger=csv"])
    admin = [c for c in instantiate_callbacks(cfg.callbacks) if type(c).__name__ == "AdminInit"]
    assert len(admin) == 1 and admin[0].mode == "closed_form"
    with pytest.raises(ConfigError, match="init.admin.mode: 'fancy' is not valid"):
        instantiate_callbacks(compose_cfg(["norm=postnorm", "init=admin", "init.admin.mode=fancy"]).callbacks)
    xavier = compose_cfg(["logger=csv"])
    assert not any(type(c).__name__ == "AdminInit" for c in instantiate_callbacks(xavier.callbacks))


NAN_AT = 5  # 0-based global step whose loss is made NaN


@pytest.mark.integration
def test_induced_nan_is_a_diverged_result(small_corpus, tmp_path_factory, monkeypatch):
    losses, finite_at_end = {}, []
    original = Seq2SeqModule.training_step

    def step(self, batch, batch_idx):
        loss = original(self, batch, batch_idx)
        losses[self.global_step] = loss.item()
        return loss * float("nan") if self.global_step == NAN_AT else loss

    def on_train_end(self):
        finite_at_end.append(all(torch.isfinite(p).all() for p in self.parameters()))

    monkeypatch.setattr(Seq2SeqModule, "training_step", step)
    monkeypatch.setattr(Seq2SeqModule, "on_train_end", on_train_end, raising=False)
    run_dir, ov = overrides(small_corpus, tmp_path_factory, "trainer.max_steps=20")
    results = run(compose_cfg(ov))  # returns normally
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["status"] == "diverged"
    assert saved["diverged_step"] == NAN_AT
    assert saved["last_finite_loss"] == pytest.approx(losses[NAN_AT - 1])
    assert "non-finite" in saved["divergence_reason"]
    assert saved["steps"] == NAN_AT + 1 < 20  # stopped right after the bad batch
    assert "valid_bleu" not in saved and "test_bleu" not in saved
    assert results["status"] == "diverged"
    assert finite_at_end == [True]  # the NaN step was skipped, weights untouched
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")  # saved at step 4, before the NaN
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


@pytest.mark.integration
def test_loss_explosion_rule(small_corpus, tmp_path_factory, monkeypatch):
    original = Seq2SeqModule.training_step

    def step(self, batch, batch_idx):  # finite, but 10x the loss from step 6 on
        loss = original(self, batch, batch_idx)
        return loss * 10 if self.global_step >= 6 else loss

    monkeypatch.setattr(Seq2SeqModule, "training_step", step)
    run_dir, ov = overrides(small_corpus, tmp_path_factory, "trainer.max_steps=20",
                            "callbacks.divergence.patience=3", "callbacks.divergence.after_step=2")
    results = run(compose_cfg(ov))
    assert results["status"] == "diverged"
    assert results["diverged_step"] == 8  # steps 6, 7, 8 above 2 x the lowest loss
    assert "explosion" in results["divergence_reason"]
    assert math.isfinite(results["last_finite_loss"])


@pytest.mark.parametrize("option, expected", [
    ("postnorm", ("layernorm", "post", False)), ("prenorm", ("layernorm", "pre", False)),
    ("scalenorm", ("scalenorm", "pre", False)), ("scalenorm_fixnorm", ("scalenorm", "pre", True)),
    ("rmsnorm", ("rmsnorm", "pre", False)), ("dyt", ("dyt", "pre", False)), ("derf", ("derf", "pre", False))])
def test_norm_options(option, expected):
    from normlab.run_config import validate_run_config

    norm = validate_run_config(compose_cfg([f"norm={option}", "logger=csv"])).norm
    assert (norm.type, norm.placement, norm.fixnorm) == expected
    # the two axes stay independent overrides
    post = validate_run_config(compose_cfg([f"norm={option}", "norm.placement=post", "logger=csv"])).norm
    assert (post.type, post.placement, post.fixnorm) == (expected[0], "post", expected[2])


@pytest.mark.integration
@pytest.mark.parametrize("option", ["b2t", "reordered", "pre_scaled", "mix", "hybrid", "hybrid_star"])
def test_a_scheme_of_2023_2025_trains_end_to_end(option, small_corpus, tmp_path_factory):
    # norm=<name> composes, trains a few steps, validates and checkpoints (issue 20, item 2)
    run_dir, ov = overrides(small_corpus, tmp_path_factory, f"norm={option}", "trainer.max_steps=4")
    results = run(compose_cfg(ov))
    assert results["status"] == "completed" and results["steps"] == 4
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 4


# Issue 20: each newer option trains a few steps end to end, and its checkpoint rebuilds the model
# (model_config alone, no Hydra; strict load_state_dict) with the option on and the trained weights.
NEW_OPTIONS = {  # option -> (overrides, what the rebuilt model must have)
    "derf": (["norm=derf"], lambda m: m.cfg.norm.type == "derf" and type(m.encoder.final_norm).__name__ == "Derf"),
    "qk_norm_l2": (["model.qk_norm=l2"], lambda m: type(m.decoder.layers[1].cross_attn.sublayer.qk_norm).__name__ == "L2QKNorm"),
    "qk_norm_rms": (["model.qk_norm=rms"], lambda m: type(m.encoder.layers[0].self_attn.sublayer.qk_norm).__name__ == "RMSQKNorm"),
    "value_residual": (["model.value_residual=true"],
                       lambda m: not torch.equal(m.decoder.layers[1].self_attn.sublayer.value_residual.lambdas,
                                                 torch.tensor([0.5, 0.5]))),  # trained away from the init
    "hyper": (["+arm=hyper", "model.residual_mixing=dynamic"],
              lambda m: m.cfg.residual == "hyper" and not torch.equal(m.encoder.layers[0].ffn.hyper.mix, torch.eye(4))),
    "mhc": (["+arm=mhc"], lambda m: m.cfg.residual == "mhc" and m.decoder.layers[1].cross_attn.hyper.dynamic),
}


@pytest.mark.integration
@pytest.mark.parametrize("option", NEW_OPTIONS)
def test_new_options_train_and_their_checkpoints_rebuild(option, small_corpus, tmp_path_factory):
    extra, has_option = NEW_OPTIONS[option]
    run_dir, ov = overrides(small_corpus, tmp_path_factory, *extra, "trainer.max_steps=4", "trainer.val_check_interval=2")
    results = run(compose_cfg(ov))
    assert results["status"] == "completed" and results["steps"] == 4
    model, tok = load_model(run_dir / "checkpoints" / "last.ckpt")
    assert has_option(model) and tok is not None
    saved = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved["model." + name]), name
    src = torch.tensor([tok.encode(["im anfang"])[0][:6] + [model.cfg.eos_id]])
    assert model(src, src[:, :3]).isfinite().all()


@pytest.mark.integration
def test_the_ngpt_arm_trains_with_unit_matrices_after_every_step(small_corpus, tmp_path_factory):
    # +arm=ngpt (Loshchilov et al. 2025; issue 38): 2 steps through train.py; the checkpoint's matrices
    # are unit along their embedding axis (the module renormalises after each optimizer step), the
    # α have moved from their init, and the decoded checkpoint gives finite logits
    run_dir, ov = overrides(small_corpus, tmp_path_factory, "+arm=ngpt", "trainer.max_steps=2",
                            "optim.warmup=0")  # the tiny overrides set a warmup, which nGPT refuses
    results = run(compose_cfg(ov))
    assert results["status"] == "completed" and results["steps"] == 2
    state = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    checked = 0
    for name, w in state.items():
        axis = (1 if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "fc1.weight", "embedding.weight"))
                else 0 if name.endswith(("out_proj.weight", "fc2.weight")) else None)
        if axis is not None:
            norms = w.norm(dim=axis)
            norms = norms[norms > 0] if name.endswith("embedding.weight") else norms  # the pad row stays 0
            torch.testing.assert_close(norms, torch.ones_like(norms), msg=name)
            checked += 1
    assert checked == 2 * 6 + 2 * 10 + 3  # 2 + 2 layers; the shared embedding under its three names
    alpha = state["model.encoder.layers.0.ffn.ngpt_alpha.s"]
    assert not torch.equal(alpha, torch.full_like(alpha, alpha.numel() ** -0.5))
    model, _ = load_model(run_dir / "checkpoints" / "last.ckpt")
    src = torch.tensor([[5, 6, 7, model.cfg.eos_id]])
    assert model(src, src[:, :2]).isfinite().all()


@pytest.mark.integration
def test_the_attnres_arm_trains_end_to_end(small_corpus, tmp_path_factory):
    # +arm=attnres_pre (Attention Residuals, Kimi Team 2026; issue 38), block form: trains 2 steps; the
    # pseudo-queries of the layers with more than one source have left their init 0
    run_dir, ov = overrides(small_corpus, tmp_path_factory, "+arm=attnres_pre", "model.attnres_block=2",
                            "trainer.max_steps=2")
    results = run(compose_cfg(ov))
    assert results["status"] == "completed" and results["steps"] == 2
    state = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    for stack in ("encoder", "decoder"):
        query = state[f"model.{stack}.aggregation.query"]
        assert query[0].eq(0).all() and query[1:].ne(0).any(-1).all()


@pytest.mark.integration
def test_the_dwa_arm_trains_end_to_end(small_corpus, tmp_path_factory):
    # +arm=dwa_pre (DenseFormer, Pagliardini et al. 2024; issue 20, item 2): trains a few steps,
    # validates and checkpoints; α has left its identity init, its upper triangle unread and unchanged
    run_dir, ov = overrides(small_corpus, tmp_path_factory, "+arm=dwa_pre", "trainer.max_steps=4")
    results = run(compose_cfg(ov))
    assert results["status"] == "completed" and results["steps"] == 4
    state = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    for stack in ("encoder", "decoder"):
        alpha = state[f"model.{stack}.aggregation.weight"]
        n = alpha.shape[0]
        identity = torch.cat((torch.zeros(n, 1), torch.eye(n)), dim=1)
        assert alpha.shape == (n, n + 1) and not torch.equal(alpha, identity)
        assert alpha.triu(diagonal=2).eq(0).all()
