"""The run's checkpoint callbacks, as `_target_` nodes (conf/callbacks/checkpoint.yaml and
step_checkpoints.yaml): Lightning's ModelCheckpoint writing into `<run dir>/checkpoints/`.

The run folder comes from the Trainer (`default_root_dir`, which train.run sets to the run
folder) when the node gives no `dirpath`, so the nodes need no path interpolation.
Writes are atomic through the Trainer's AtomicCheckpointIO plugin (normlab.checkpoint).
"""
from __future__ import annotations

import os

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from normlab.private_api import saved_last


class RunCheckpoint(ModelCheckpoint):
    def __init__(self, **kwargs):
        # a continued run (normlab.run_folder) rewrites its own files, never best-step8-v1.ckpt beside them
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(**kwargs)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        super().setup(trainer, pl_module, stage)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # Lightning restores the rest of its state but not the last saved score, nor which file it
        # saved last (lightning 2.6): a continued run's checkpoints then held None where the
        # uninterrupted run's hold the score, and its on_train_end wrote a last.ckpt of the last
        # step where the uninterrupted run's is of its last top-k save (private_api.saved_last)
        if self.dirpath == state_dict.get("dirpath", self.dirpath):
            self.current_score = state_dict.get("current_score", self.current_score)
            if state_dict.get("last_model_path"):  # save_last's file is the last each top-k save writes
                saved_last(self, state_dict["last_model_path"])


class BestCheckpoint(RunCheckpoint):
    """last.ckpt and best-step<N>.ckpt by `monitor`. With validation BLEU off (`eval.valid_bleu:
    false`) a BLEU monitor is never logged: the best is then the lowest `valid/loss`. With
    `eval.valid_subset` the logged valid/bleu is the subset's, and so is the choice.

    A validation that scored the loss only while a stall was held (callbacks/stall.py,
    lit_module.decode_valid) has no valid/bleu or valid/chrf: it ranks below every decoded one, as
    Lightning ranks a NaN (−inf under max), so it is the best only when no validation decoded (the
    run's first validation at its stall stop), and an earlier validation's value, still in the
    trainer's metrics, is not taken for its own."""

    def __init__(self, monitor: str = "valid/bleu", mode: str = "max", valid_bleu: bool = True,
                 filename: str = "best-step{step}", **kwargs):
        if not valid_bleu and "bleu" in monitor:
            monitor, mode = "valid/loss", "min"
        super().__init__(monitor=monitor, mode=mode, filename=filename, auto_insert_metric_name=False, **kwargs)

    best_saved_at: tuple[str, int] | None = None  # (best_model_path, step): the best saved by this process

    def on_validation_end(self, trainer, pl_module) -> None:
        before = self.best_model_path
        super().on_validation_end(trainer, pl_module)
        if self.best_model_path and self.best_model_path != before:  # this validation's weights are the best
            self.best_saved_at = (self.best_model_path, trainer.global_step)

    def _monitor_candidates(self, trainer) -> dict:
        candidates = super()._monitor_candidates(trainer)
        decoded = self.monitor in ("valid/bleu", "valid/chrf")
        if decoded and not trainer.lightning_module.decode_valid:  # Seq2SeqModule's: a stall held
            candidates[self.monitor] = torch.tensor(float("-inf") if self.mode == "max" else float("inf"))
        return candidates


class StepCheckpoint(RunCheckpoint):
    """Weights-only step<N>.ckpt every `every_n_steps` optimizer steps, the last `keep_last_n` kept:
    the series that checkpoint averaging reads (normlab.averaging). 0 in either disables it."""

    def __init__(self, keep_last_n: int = 5, every_n_steps: int = 100, **kwargs):
        self.keep_last_n, self.every_n_steps = int(keep_last_n or 0), int(every_n_steps or 0)
        on = self.keep_last_n > 0 and self.every_n_steps > 0
        super().__init__(filename="step{step}", monitor="step", mode="max", save_top_k=self.keep_last_n if on else 0,
                         every_n_train_steps=self.every_n_steps if on else 0, save_weights_only=True,
                         save_last=False, auto_insert_metric_name=False, **kwargs)
