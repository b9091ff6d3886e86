import math

import pytest

from normlab.lr_schedule import constant_factor, inverse_sqrt_factor, lr_factor, peak_lr


def paper_lr(step, d_model, warmup, scale=1.0):
    # Vaswani et al. 2017, eq. (3): lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


@pytest.mark.parametrize("step", [1, 10, 1000, 3999, 4000, 4001, 10000, 100000])
def test_matches_paper_formula(step):
    d, w = 512, 4000
    lr = peak_lr(d, w, lr=None) * inverse_sqrt_factor(step, w)
    assert lr == pytest.approx(paper_lr(step, d, w), rel=1e-12)


def test_known_values():
    # At step == warmup the paper's lr for base (d=512, warmup=4000) is 512^-0.5 * 4000^-0.5.
    assert peak_lr(512, 4000, None) == pytest.approx(6.987712429686844e-04)
    assert inverse_sqrt_factor(4000, 4000) == 1.0
    assert inverse_sqrt_factor(16000, 4000) == pytest.approx(0.5)
    assert inverse_sqrt_factor(1, 4000) == pytest.approx(1 / 4000)


def test_explicit_peak_and_no_warmup():
    assert peak_lr(128, 150, lr=3e-3) == 3e-3
    assert inverse_sqrt_factor(4, 0) == pytest.approx(0.5)
    assert inverse_sqrt_factor(75, 150) == pytest.approx(0.5)
    assert inverse_sqrt_factor(600, 150) == pytest.approx(math.sqrt(150 / 600))


def test_constant_schedule():
    assert [constant_factor(s, 100) for s in (1, 50, 100, 101, 10_000)] == [0.01, 0.5, 1.0, 1.0, 1.0]
    assert constant_factor(1, 0) == constant_factor(10_000, 0) == 1.0
    assert lr_factor("constant", 400, 100) == 1.0
    assert lr_factor("inverse_sqrt", 400, 100) == pytest.approx(0.5)


def test_inverse_sqrt_hold_is_the_peak_then_inverse_sqrts_decay():
    """No ramp: the peak from step 1 to `warmup`, then exactly inverse_sqrt's multiple (nGPT's arm in the
    stability study beside arms with a 200-step warmup)."""
    assert [lr_factor("inverse_sqrt_hold", s, 200) for s in (1, 100, 200)] == [1.0, 1.0, 1.0]
    for step in (201, 800, 4000):
        assert lr_factor("inverse_sqrt_hold", step, 200) == pytest.approx(math.sqrt(200 / step))
        assert lr_factor("inverse_sqrt_hold", step, 200) == lr_factor("inverse_sqrt", step, 200)
    assert lr_factor("inverse_sqrt_hold", 16, 0) == pytest.approx(0.25)  # no hold: inverse_sqrt without warmup


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "constant", "inverse_sqrt_hold"])
def test_module_optimizer_follows_the_schedule(schedule):
    # The lr the optimizer actually uses at optimizer step k (1-based) is peak * factor(k).
    import torch

    from normlab.config import ModelConfig
    from normlab.lit_module import Seq2SeqModule
    from normlab.settings import EvalSpec, OptimSpec

    optim = OptimSpec(lr=2e-3, warmup=4, schedule=schedule, betas=[0.9, 0.98], eps=1e-9, label_smoothing=0.1)
    cfg = ModelConfig(vocab_size=20, d_model=8, encoder_layers=1, decoder_layers=1, encoder_heads=2,
                      decoder_heads=2, encoder_ffn=8, decoder_ffn=8)
    module = Seq2SeqModule(cfg.to_dict(), optim=optim, eval=EvalSpec())
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    for step in range(1, 12):
        assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * lr_factor(schedule, step, 4))
        opt.step()
        sched.step()


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decaying_schedules_warm_up_then_reach_zero_after_the_last_step(schedule):
    # the ramp as every schedule's, then fairseq's cosine (min_lr 0) or polynomial_decay (power 1, end 0),
    # read from the updates done after the warmup: update k > warmup decays by (k - 1 - warmup) / (total - warmup)
    assert [lr_factor(schedule, s, 100, 600) for s in (1, 50, 100, 101)] == [0.01, 0.5, 1.0, 1.0]
    last = lr_factor(schedule, 600, 100, 600)  # the run's last update still moves the weights
    assert last == pytest.approx(1 / 500 if schedule == "linear" else (1 + math.cos(math.pi * 499 / 500)) / 2)
    assert last > 0
    assert lr_factor(schedule, 601, 100, 600) == pytest.approx(0.0, abs=1e-15)  # one past the run: 0
    assert lr_factor(schedule, 700, 100, 600) == pytest.approx(0.0, abs=1e-15)  # and it stays there
    assert lr_factor(schedule, 351, 100, 600) == pytest.approx(0.5)  # halfway: cos(pi/2) = 0, half the peak
    quarter = lr_factor(schedule, 226, 100, 600)
    assert quarter == pytest.approx((1 + math.cos(math.pi / 4)) / 2 if schedule == "cosine" else 0.75)
    assert lr_factor(schedule, 1, 0, 10) == 1.0  # no warmup: the peak at step 1, 1/10 of it at step 10
    assert lr_factor(schedule, 10, 0, 10) == pytest.approx(0.1 if schedule == "linear" else (1 + math.cos(math.pi * 0.9)) / 2)
    with pytest.raises(ValueError):
        lr_factor(schedule, 5, 1, None)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_module_decays_towards_zero_by_the_trainers_max_steps(schedule, monkeypatch):
    from types import SimpleNamespace

    from normlab.config import ModelConfig
    from normlab.lit_module import Seq2SeqModule
    from normlab.settings import EvalSpec, OptimSpec

    cfg = ModelConfig(vocab_size=20, d_model=8, encoder_layers=1, decoder_layers=1, encoder_heads=2,
                      decoder_heads=2, encoder_ffn=8, decoder_ffn=8)
    module = Seq2SeqModule(cfg.to_dict(), optim=OptimSpec(lr=2e-3, warmup=2, schedule=schedule), eval=EvalSpec())
    monkeypatch.setattr(module, "_attached_trainer", lambda: SimpleNamespace(max_steps=10))
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2e-3 * lr_factor(schedule, k, 2, 10) for k in range(1, 11)])
    assert seen[1] == seen[2] == pytest.approx(2e-3) and 0 < seen[-1] <= 2e-3 / 8 * (1 + 1e-9)


@pytest.mark.parametrize("steps", [-1, 100])
def test_a_decaying_schedule_without_steps_after_its_warmup_is_refused(steps):
    from conftest import compose_cfg

    from normlab.config import ConfigError
    from normlab.run_config import validated

    cfg = compose_cfg(["optim.schedule=cosine", "optim.warmup=100", f"trainer.max_steps={steps}"])
    with pytest.raises(ConfigError) as e:
        validated(cfg)
    assert str(e.value) == (f"optim.schedule=cosine: it decays to 0 at trainer.max_steps, and trainer.max_steps="
                            f"{steps} is not after optim.warmup=100 (allowed: trainer.max_steps above optim.warmup, "
                            "or optim.schedule=inverse_sqrt|constant|inverse_sqrt_hold)")
    validated(compose_cfg(["optim.schedule=cosine", "optim.warmup=100", "trainer.max_steps=101"]))


def test_a_changed_schedule_is_told_where_the_lr_jumps_or_the_curve_bends():
    """resume= under another schedule, warmup or total (tests/test_schedule_resume.py trains it): a
    cosine to 8 with warmup 2, after 4 updates (its scheduler's state as LambdaLR saves it)."""
    from normlab.lr_schedule import schedule_change_note

    sched = {"_last_lr": [1.5e-3], "base_lrs": [2e-3], "last_epoch": 4}  # 2e-3 * (1 + cos(pi * 2/6)) / 2
    assert schedule_change_note(("cosine", 2, 8), ("cosine", 2, 8), sched) is None  # nothing changed
    assert schedule_change_note(("cosine", 2, 8), ("cosine", 2, 12), sched) == (
        "trainer.max_steps 8 -> 12: the learning rate of update 5 jumps from 0.0015 to 0.001809")
    # unrecorded (a checkpoint from before the total was saved): told by the lr alone
    assert schedule_change_note(("cosine", 2, None), ("cosine", 2, 8), sched) is None
    assert schedule_change_note(("cosine", None, None), ("cosine", 2, 12), sched).startswith(
        "the schedule (the checkpoint names none of its settings that differ): the learning rate of update 5 jumps")
    # another schedule or warmup at the same total jumps too (on_train_start applies it)
    assert schedule_change_note(("cosine", 2, 8), ("inverse_sqrt", 2, 8), sched) == (
        "optim.schedule cosine -> inverse_sqrt: the learning rate of update 5 jumps from 0.0015 to 0.001265")
    # inverse_sqrt has no total: another max_steps changes nothing
    flat = {"_last_lr": [2e-3 * (2 / 5) ** 0.5], "base_lrs": [2e-3], "last_epoch": 4}
    assert schedule_change_note(("inverse_sqrt", 2, 8), ("inverse_sqrt", 2, 12), flat) is None
    # within warmup the lr does not depend on the total: no jump now, a curve that bends later
    warm = {"_last_lr": [1e-3], "base_lrs": [2e-3], "last_epoch": 1}  # update 2 of warmup 4: 2e-3 * 2/4
    assert schedule_change_note(("cosine", 4, 8), ("cosine", 4, 12), warm) == (
        "trainer.max_steps 8 -> 12: the learning rate of update 2 stays 0.001; the updates after it follow the new one")