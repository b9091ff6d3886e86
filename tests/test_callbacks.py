"""Every callback is a `_target_` node under `callbacks`, composed by Hydra defaults."""
import pytest
from lightning.pytorch.callbacks import LearningRateMonitor

from normlab.callbacks import instantiate_callbacks
from normlab.callbacks.checkpoints import BestCheckpoint, StepCheckpoint
from normlab.config import ConfigError

from conftest import compose_cfg


def names(cfg):
    return [type(c).__name__ for c in instantiate_callbacks(cfg.callbacks)]


def test_default_callbacks_in_config_order_and_admin_adds_its_own():
    # (the progress bar is a factory that declines when stdout is not a terminal, as under pytest)
    assert names(compose_cfg([])) == ["BestCheckpoint", "StepCheckpoint", "DivergenceGuard", "StallGuard", "PlateauStop",
                                      "ValidateAtEnd", "Diagnostics", "DropHeadSchedule", "TrainLog", "FullStateCheckpoint",
                                      "Preemption"]
    admin = compose_cfg(["norm=postnorm", "init=admin", "init.admin.batches=2"])
    assert names(admin).count("AdminInit") == 1
    assert instantiate_callbacks(admin.callbacks)[0].batches == 2  # init.admin.* reach the callback


def test_any_node_with_a_target_is_instantiated_and_nodes_can_be_removed():
    cfg = compose_cfg(["+callbacks.lr_monitor._target_=lightning.pytorch.callbacks.LearningRateMonitor",
                       "~callbacks.diagnostics"])
    built = instantiate_callbacks(cfg.callbacks)
    assert any(isinstance(c, LearningRateMonitor) for c in built)
    assert "Diagnostics" not in [type(c).__name__ for c in built]


def test_checkpoint_nodes():
    best = instantiate_callbacks(compose_cfg([]).callbacks)[0]
    assert isinstance(best, BestCheckpoint) and (best.monitor, best.mode) == ("valid/bleu", "max")
    no_bleu = instantiate_callbacks(compose_cfg(["eval.valid_bleu=false"]).callbacks)[0]
    assert (no_bleu.monitor, no_bleu.mode) == ("valid/loss", "min")  # BLEU is never logged then
    steps = StepCheckpoint(keep_last_n=3, every_n_steps=10)
    assert (steps.save_top_k, steps._every_n_train_steps, steps.save_weights_only) == (3, 10, True)
    off = StepCheckpoint(keep_last_n=0, every_n_steps=10)
    assert (off.save_top_k, off._every_n_train_steps) == (0, 0)


def test_a_bad_callback_value_is_a_config_error_naming_its_key():
    with pytest.raises(ConfigError, match=r"callbacks\.drophead_schedule\.schedule: 'zigzag' is not valid \(allowed: constant, v_shape\)"):
        instantiate_callbacks(compose_cfg(["callbacks.drophead_schedule.schedule=zigzag"]).callbacks)


def test_the_step_bar_refreshes_every_refresh_rate_steps_and_at_the_last():
    """StepProgressBar's rule (TQDMProgressBar's, on its public settings): steps 3, 6 and 7 of 7 at
    refresh_rate 3; none with the bar disabled."""
    from types import SimpleNamespace

    from normlab.callbacks.progress import StepProgressBar

    class Bar:
        total, n, shown = 7, 0, []

        def set_postfix(self, metrics, refresh=True):
            self.shown.append(self.n)

    for rate, want in ((3, [3, 6, 7]), (0, [])):
        cb = StepProgressBar(refresh_rate=rate)
        cb.train_progress_bar = Bar()
        cb.train_progress_bar.shown = []
        for step in range(1, 8):
            trainer = SimpleNamespace(global_step=step, progress_bar_metrics={}, optimizers=[])
            cb.on_train_batch_end(trainer, SimpleNamespace(stats=SimpleNamespace(tokens_per_s=0.0)), None, None, step)
        assert cb.train_progress_bar.shown == want, rate


def test_a_continued_best_checkpoint_is_the_uninterrupted_ones(tmp_path):
    """What Lightning's ModelCheckpoint does not restore (lightning 2.6), BestCheckpoint does: the last
    saved score, and that it saved last.ckpt already, so that a continued run does not write a last.ckpt
    of its last step at the end of training where the uninterrupted run's is of its last top-k save."""
    from types import SimpleNamespace

    import torch

    before = BestCheckpoint(dirpath=str(tmp_path), save_last=True)
    before.current_score, before.last_model_path = torch.tensor(3.0), str(tmp_path / "last.ckpt")
    before.best_model_path = str(tmp_path / "best-step3.ckpt")
    written = []
    trainer = SimpleNamespace(callback_metrics={}, current_epoch=0, global_step=6,
                              lightning_module=SimpleNamespace(decode_valid=True))
    for saved in (False, True):  # a fresh callback writes last.ckpt at the end; one that saved it does not
        after = BestCheckpoint(dirpath=str(tmp_path), save_last=True)
        after._save_last_checkpoint = lambda trainer, candidates, saved=saved: written.append(saved)
        if saved:
            after.load_state_dict(before.state_dict())
            assert torch.equal(after.current_score, torch.tensor(3.0))
        after.on_train_end(trainer, None)
    assert written == [False]
