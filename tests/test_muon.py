"""optim=muon (src/normlab/optimizers.py, issue 38): torch.optim.Muon on the hidden matrices, AdamW on
the rest, as one optimizer that Lightning drives; checked against torch's Muon applied by hand and the
update's formula (Jordan et al. 2024; the RMS-matching rate of Liu et al. 2025)."""
import math

import pytest
import torch
from torch import nn

from normlab import identity
from normlab.config import ConfigError, ModelConfig, NormConfig
from normlab.lit_module import Seq2SeqModule
from normlab.lr_schedule import lr_factor, peak_lr
from normlab.optimizers import MuonWithAdamW, build_optimizer, parameter_groups
from normlab.settings import EvalSpec, OptimSpec

from conftest import compose_cfg, tiny_overrides
from test_optimizers import BASE, EPS, LR, WD, model

MUON = OptimSpec(optimizer="muon", weight_decay=WD)
MU, ABC, STEPS = 0.95, (3.4445, -4.7750, 2.0315), 5  # torch's defaults, which optim=muon keeps


def newton_schulz(g: torch.Tensor) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Jordan et al. 2024 in fp64 (torch runs it in bf16):
    X <- aX + (bA + cA²)X with A = XXᵀ, from X = G/‖G‖_F, on the wide orientation."""
    a, b, c = ABC
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / x.norm()
    for _ in range(STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _names(m: nn.Module, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in m.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("norm", [NormConfig(), NormConfig(placement="rezero", type="none")])
def test_muon_takes_the_attention_and_ffn_matrices_and_adamw_the_rest(norm):
    m = model(norm=norm)
    opt = build_optimizer(m, MUON, LR, {})
    muon = _names(m, [p for g in opt.muon.param_groups for p in g["params"]])
    adamw = _names(m, [p for g in opt.adamw.param_groups for p in g["params"]])
    projections = {f"{n}.weight" for n, x in m.named_modules() if isinstance(x, nn.Linear)}
    assert muon == projections and all(n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
                                       for n in muon)
    layers = BASE["encoder_layers"] * 6 + BASE["decoder_layers"] * 10  # q, k, v, out (x2 in the decoder), fc1, fc2
    assert len(muon) == layers and not muon & adamw and muon | adamw == {n for n, _ in m.named_parameters()}
    assert "encoder.embed.tokens.embedding.weight" in adamw  # the (tied) embedding and output projection
    assert all(p.ndim == 2 for g in opt.muon.param_groups for p in g["params"])
    if norm.placement == "rezero":  # the scheme's scalars go to AdamW
        assert {n for n, _ in parameter_groups(m)["scheme"]} <= adamw


def _grads(m: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def test_one_step_is_torchs_muon_and_adamw_applied_by_hand_and_the_formula():
    """The wrapper's first step equals torch.optim.Muon (match_rms_adamw) on the matrices and AdamW on the
    rest, applied by hand to copies, bit for bit; and the update is the papers': Nesterov momentum from
    zero is a multiple of G, orthogonalised by Newton-Schulz (O: singular values near 1), and
    W <- W·(1 - lr·wd) - lr·0.2·√max(A, B)·O (Liu et al. 2025's RMS match), to bf16's precision;
    AdamW's first step is lr·g/(|g| + eps) on the undecayed groups, exactly."""
    m, ref = model(), model()
    grads = _grads(m)
    for n, p in ref.named_parameters():
        p.grad = grads[n].clone()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    build_optimizer(m, MUON, LR, {"foreach": True}).step()
    matrices = _names(m, [p for _, p in parameter_groups(m)["matrices"]])
    by_name = dict(ref.named_parameters())
    torch.optim.Muon([by_name[n] for n in sorted(matrices)], lr=LR, weight_decay=WD,
                     adjust_lr_fn="match_rms_adamw").step()
    torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in matrices], lr=LR, betas=(0.9, 0.98),
                      eps=EPS, weight_decay=0.0, foreach=True).step()
    for n, p in m.named_parameters():
        assert torch.equal(p, by_name[n]), n
        g, w = grads[n], before[n]
        if n in matrices:
            o = (w * (1 - LR * WD) - p.detach()) / (LR * 0.2 * math.sqrt(max(w.shape)))  # the update's O
            assert (o - newton_schulz((1 + MU) * g)).norm() < 0.04 * o.norm(), n  # bf16: ~1.5% measured
            assert 0.3 < torch.linalg.svdvals(o).min() and torch.linalg.svdvals(o).max() < 1.7, n
        else:
            torch.testing.assert_close(p.detach(), w - LR * g / (g.abs() + EPS), rtol=1e-12, atol=1e-12, msg=n)


def test_the_schedule_scales_both_parts_and_the_state_round_trips():
    torch.manual_seed(0)
    module = Seq2SeqModule(ModelConfig(**BASE).to_dict(), optim=OptimSpec(optimizer="muon", warmup=4), eval=EvalSpec())
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(opt, MuonWithAdamW)
    peak = peak_lr(module.model_cfg.d_model, 4, None, 1.0)
    for step in range(1, 4):
        _grads(module.model)
        opt.step()
        sched.step()
        rates = {g["group"]: g["lr"] for g in opt.param_groups}
        assert rates["matrices"] == opt.muon.param_groups[0]["lr"] and len(set(rates.values())) == 1
        assert rates["matrices"] == pytest.approx(peak * lr_factor("inverse_sqrt", step + 1, 4), rel=1e-12)
    again = build_optimizer(module.model, module.optim_spec, peak, {})
    again.load_state_dict(opt.state_dict())
    assert again.muon.state is again.state and again.adamw.param_groups[0] is again.param_groups[1]
    m0 = next(iter(opt.muon.param_groups[0]["params"]))
    assert torch.equal(again.state[m0]["momentum_buffer"], opt.state[m0]["momentum_buffer"])


def test_the_run_log_lists_each_part_and_group(caplog):
    m = model()
    with caplog.at_level("INFO", logger="normlab"):
        build_optimizer(m, MUON, LR, {})
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("optim muon group matrices: muon (lr x 0.2·√max(rows, cols)), weight_decay 0.1, ")
    assert [ln.split(",")[0] for ln in lines[1:]] == [f"optim muon group {g}: adamw" for g in ("embeddings", "gains",
                                                                                                 "biases")]
    assert all(", weight_decay 0, " in ln for ln in lines[1:])


def test_muon_reads_no_decay_and_names_a_new_run():
    OptimSpec.of({"optimizer": "muon", "no_decay": ["embeddings"]}).validate()  # its AdamW part reads it
    with pytest.raises(ConfigError, match=r"^optim\.optimizer: "):
        OptimSpec.of({"optimizer": "lion"}).validate()
    h = identity.identity_hash
    assert h(compose_cfg(["model.d_model=32", "optim=muon"])) != h(compose_cfg(["model.d_model=32", "optim=adamw"]))


@pytest.mark.integration
def test_a_muon_run_pauses_and_continues_exactly_and_refuses_another_optimizer(small_corpus, tmp_path):
    """Its optimizer state (Muon's momentum, AdamW's moments) is checkpointed and restored: paused at
    step 2 and continued, the run ends where the straight one does; resume= under adamw is refused."""
    from normlab.train import run

    def args(name, *extra, optim="muon"):
        return compose_cfg(tiny_overrides(small_corpus, tmp_path / name, tmp_path / "cache") + [
            f"optim={optim}", "trainer.max_steps=4", "eval.valid_bleu=false", "eval.test=false",
            "callbacks.full_checkpoint.every_n_steps=2", *extra])

    straight = run(args("straight"))
    assert straight["status"] == "completed" and math.isfinite(straight["valid_loss"])
    assert run(args("paused", "callbacks.preemption.stop_at_step=2"))["status"] == "stopped"
    assert run(args("paused"))["valid_loss"] == straight["valid_loss"]
    start = tmp_path / "straight" / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"^optim\.optimizer: 'adamw': resume=.* trained with 'muon'"):
        run(args("other", f"resume={start}", "trainer.max_steps=6", optim="adamw"))
