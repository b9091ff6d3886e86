"""What happens to an update's gradient before its step (issue 38): its norm measured once and read by
every user (clip rate, clipping, the text line, the divergence guard), an update whose norm spikes
skipped (optim.skip_spikes, src/normlab/spikes.py), and the guards watching the loss without z-loss."""
import csv
import dataclasses
import re

import lightning as L
import numpy as np
import pytest
import torch

from normlab import identity
from normlab.config import ConfigError
from normlab.lit_module import Seq2SeqModule
from normlab.settings import EvalSpec, OptimSpec
from normlab.spikes import STEPS_KEPT, SpikeGate
from normlab.train import run

from conftest import SpikeAtStep, compose_cfg, tiny_overrides
from test_accumulation import MODEL, OPTIM, batch


def reference_skips(norms: list[float], k: float, window: int) -> list[int]:
    """The rule written out with numpy: skipped where the window of the N norms before is full and the
    norm exceeds k x its median; every norm enters the window."""
    return [t for t in range(window, len(norms)) if norms[t] > k * np.median(norms[t - window:t])]


@pytest.mark.parametrize("window", [4, 5])  # an even window: the median is the mean of the middle two
def test_the_spike_rule_on_a_hand_made_sequence(window):
    k = 3.0
    # filling (a spike among the first N is never skipped), steady, a spike, exactly k x the median (not
    # skipped: strictly above), then a lasting rise that the median follows after N/2 updates
    norms = [1.0, 50.0, 2.0, 1.5, 1.0, 1.2, 1.1, 30.0, 1.0] + [3 * 1.1] + [20.0] * 8
    gate = SpikeGate(k, window)
    skipped = [t for t, g in enumerate(norms) if gate.skip(g, t)]
    assert skipped == reference_skips(norms, k, window)
    assert 7 in skipped and 1 not in skipped  # the spike in the window's filling is not skipped
    assert skipped[-1] < len(norms) - 1  # the rise is accepted once it is the median
    assert gate.record() == {"skipped_updates": len(skipped), "skipped_steps": skipped}


def test_nothing_is_skipped_before_the_window_is_full_and_the_steps_are_capped():
    gate = SpikeGate(2.0, 3)
    assert not any(gate.skip(g, t) for t, g in enumerate([1.0, 1e9, 1e12]))  # 2 norms before: no median yet
    steady = SpikeGate(2.0, 1)
    steady.skip(1.0, 0)
    for t in range(1, 2 * STEPS_KEPT + 2, 2):  # alternate a spike and a return to 1
        assert steady.skip(10.0, t) and not steady.skip(1.0, t + 1)
    assert steady.skipped == STEPS_KEPT + 1 and steady.steps == list(range(1, 2 * STEPS_KEPT, 2))


def test_a_gate_restored_from_its_state_decides_as_the_straight_one():
    norms = [1.0, 1.1, 0.9, 1.2, 5.0, 1.0, 6.0, 1.1]
    straight = SpikeGate(3.0, 3)
    expected = [straight.skip(g, t) for t, g in enumerate(norms)]
    first = SpikeGate(3.0, 3)
    decided = [first.skip(g, t) for t, g in enumerate(norms[:4])]
    resumed = SpikeGate(3.0, 3)
    resumed.load_state_dict(first.state_dict())
    decided += [resumed.skip(g, t) for t, g in enumerate(norms[4:], 4)]
    assert decided == expected and resumed.record() == straight.record() and any(expected)


@pytest.mark.parametrize("values, key", [({"skip_spikes": 1.0}, "optim.skip_spikes"),
                                         ({"skip_spikes": "big"}, "optim.skip_spikes"),
                                         ({"skip_spikes": float("inf")}, "optim.skip_spikes"),  # never skips
                                         ({"skip_spikes": 5, "spike_window": 0}, "optim.spike_window"),
                                         ({"skip_spikes": 5, "spike_window": 2.5}, "optim.spike_window"),
                                         # read with skip_spikes alone: it would rename a run it does not change
                                         ({"spike_window": 50}, "optim.spike_window")])
def test_a_bad_spike_setting_is_refused_by_its_key(values, key):
    with pytest.raises(ConfigError) as e:
        OptimSpec.of(values).validate()
    assert str(e.value).startswith(f"{key}: ") and "allowed" in str(e.value)


def test_spike_skipping_names_a_new_run_and_its_defaults_name_none():
    base, h = ["model.d_model=32"], identity.identity_hash
    assert h(compose_cfg(base + ["optim.skip_spikes=null", "optim.spike_window=100"])) == h(compose_cfg(base))
    assert h(compose_cfg(base + ["optim.skip_spikes=5"])) != h(compose_cfg(base))


class _Record(L.Callback):
    """The weights and the optimizer's step counts after every update, and the rate each step used."""

    def __init__(self):
        self.weights, self.adam_steps, self.lrs = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.weights.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})
        opt = trainer.optimizers[0]
        self.adam_steps.append(max(float(s["step"]) for s in opt.state.values()))


def _fit(callbacks: list, optim: OptimSpec, steps: int = 6) -> Seq2SeqModule:
    torch.manual_seed(0)
    module = Seq2SeqModule(MODEL, optim=optim, eval=EvalSpec())
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch(s, 4) for s in range(steps)],
                                                                      batch_size=None))
    return module


def test_a_skipped_update_changes_nothing_but_the_schedule_advances():
    spiky = dataclasses.replace(OPTIM, skip_spikes=100.0, spike_window=2, warmup=8)
    rec, plain = _Record(), _Record()
    module = _fit([SpikeAtStep(step=3), rec], spiky)
    _fit([plain], dataclasses.replace(spiky, skip_spikes=None))
    assert module.spikes.record() == {"skipped_updates": 1, "skipped_steps": [3]}
    for n, w in rec.weights[3].items():  # the update of step 3 did not happen: weights as after step 2
        assert torch.equal(w, rec.weights[2][n]), n
    assert all(torch.equal(w, plain.weights[2][n]) for n, w in rec.weights[2].items())  # the same run before it
    assert rec.adam_steps == [1, 2, 3, 3, 4, 5]  # Adam's own count (bias correction) skips it
    assert rec.lrs == plain.lrs and rec.lrs[4] > rec.lrs[3]  # the warmup goes on by step number


def _rows(run_dir, key):
    return [(int(r["step"]), float(r[key])) for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv"))
            if r.get(key)]


SPIKE = ["optim.skip_spikes=100", "optim.spike_window=3", "+callbacks.spike._target_=conftest.SpikeAtStep",
         "+callbacks.spike.step=5", "eval.valid_bleu=false", "eval.test=false", "trainer.log_every_n_steps=1",
         "callbacks.full_checkpoint.every_n_steps=4"]


@pytest.mark.integration
def test_a_forced_spike_is_skipped_and_recorded_even_across_a_pause(small_corpus, tmp_path):
    """A run whose step 5 gradient is multiplied by 1e6 skips exactly that update (results.json, the
    logged train/skipped); paused at step 4 and continued, the restored window (3 norms) skips it too,
    where a fresh one would not yet be full."""
    def args(name):
        return tiny_overrides(small_corpus, tmp_path / name, tmp_path / "cache") + SPIKE

    straight = run(compose_cfg(args("straight")))
    assert straight["status"] == "completed" and straight["steps"] == 8
    assert (straight["skipped_updates"], straight["skipped_steps"]) == (1, [5])
    assert [v for _, v in _rows(tmp_path / "straight", "train/skipped")] == [0.0] * 5 + [1.0] * 3
    paused = run(compose_cfg(args("paused") + ["callbacks.preemption.stop_at_step=4"]))
    assert (paused["status"], paused["skipped_updates"]) == ("stopped", 0)
    continued = run(compose_cfg(args("paused")))
    assert (continued["skipped_updates"], continued["skipped_steps"]) == (1, [5])
    assert continued["valid_loss"] == straight["valid_loss"]


@pytest.mark.integration
def test_the_gradient_norm_is_measured_once_per_update_and_read_by_all(small_corpus, tmp_path, monkeypatch, caplog):
    """With clipping, spike skipping, the divergence guard and a text line at every step: one norm per
    update (torch's get_total_norm, no clip_grad_norm_ measuring again), and the text line's gnorm is it."""
    measured, clip_calls = [], []
    total_norm, clip = torch.nn.utils.get_total_norm, torch.nn.utils.clip_grad_norm_

    def counting_norm(*a, **k):
        out = total_norm(*a, **k)
        measured.append(float(out))
        return out

    monkeypatch.setattr(torch.nn.utils, "get_total_norm", counting_norm)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: clip_calls.append(1) or clip(*a, **k))
    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache")
                      + ["optim.clip_norm=1.0", "optim.skip_spikes=100", "trainer.max_steps=4",
                         "trainer.log_every_n_steps=1", "eval.valid_bleu=false", "eval.test=false"])
    with caplog.at_level("INFO", logger="normlab"):
        assert run(cfg)["status"] == "completed"
    assert len(measured) == 4 and clip_calls == []
    gnorms = [float(g) for g in re.findall(r"\| gnorm ([\d.]+) \|", caplog.text)]
    assert gnorms == [pytest.approx(g, abs=5e-4) for g in measured]
    rates = [v for _, v in _rows(tmp_path / "run", "train/clip_rate")]
    assert rates == [float(g > 1.0) for g in measured]


def test_the_guards_watch_the_loss_without_z_loss():
    """With optim.z_loss the objective adds z·Σlog²Z; what the divergence and stall guards read
    (`token_loss`) is the per-token label-smoothed loss, as the same weights give without it."""
    b = batch(1, 4)
    torch.manual_seed(0)
    with_z = Seq2SeqModule(MODEL, optim=dataclasses.replace(OPTIM, z_loss=0.3), eval=EvalSpec())
    without = Seq2SeqModule(MODEL, optim=OPTIM, eval=EvalSpec())
    without.load_state_dict(with_z.state_dict())
    out, plain = with_z.training_step(b, 0), without.training_step(b, 0)
    assert out["loss"] > plain + 0.1  # z = 0.3 of log²Z ≈ log² 40 per token: the objective moved
    torch.testing.assert_close(out["token_loss"], plain.detach(), rtol=1e-6, atol=1e-6)


def test_a_skip_under_fp16s_scaler_with_fused_adam_steps_nothing(monkeypatch):
    """16-mixed with fused Adam (which adam_on_gpu avoids with skip_spikes today; the gate does not rely on
    it): Lightning calls scaler.step and scaler.update after a skip too, and update() needs this step's inf
    check, which fused Adam makes only in its step over the gradients the skip has dropped. Driven as on a
    GPU, on the CPU: torch's GradScaler("cpu"), fused Adam on the CPU, Lightning's MixedPrecision."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    monkeypatch.setattr(Seq2SeqModule, "_adam_impl", lambda self: {"fused": True})
    spiky = dataclasses.replace(OPTIM, skip_spikes=100.0, spike_window=2, warmup=8)
    rec, steps = _Record(), 6
    torch.manual_seed(0)
    module = Seq2SeqModule(MODEL, optim=spiky, eval=EvalSpec())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[SpikeAtStep(step=3), rec],
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch(s, 4) for s in range(steps)],
                                                                      batch_size=None))
    assert trainer.optimizers[0].param_groups[0]["fused"]
    assert module.spikes.record() == {"skipped_updates": 1, "skipped_steps": [3]}
    for n, w in rec.weights[3].items():  # the update of step 3 did not happen: weights as after step 2
        assert torch.equal(w, rec.weights[2][n]), n
    assert rec.adam_steps == [1, 2, 3, 3, 4, 5]  # fused Adam's own count skips it too
    assert scaler.get_scale() == 2.0 ** 8  # no overflow, no growth yet (growth_interval 2000)
