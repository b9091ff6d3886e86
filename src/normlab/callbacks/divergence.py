"""Divergence is a result, not a crash (Wang et al. 2019 and Liu et al. 2020 report deep post-norm
runs as "failed"/"diverged": a depth ablation must be able to print that in a cell).

Rules (either stops the run):
- non-finite: the training loss or the gradient is NaN/inf. The optimizer step of that batch is
  skipped (the module drops every gradient before `optimizer.step`, so Adam leaves the weights and
  its moments untouched: lit_module.configure_gradient_clipping), so the weights stay finite. The
  gradient's norm is the module's, measured once per update (lit_module.TrainStats.grad_norm).
  With fp16 (`precision=16-mixed`) a loss scaler is at work: an inf/NaN gradient there is an
  overflow of the scaled loss, which the scaler answers by skipping the step and lowering its
  scale, as designed (counted as `train/overflow_steps`, not divergence). Only a non-finite loss
  for `patience` consecutive steps is divergence then.
- explosion: after `after_step` optimizer steps, the loss stays above `factor` × (lowest loss
  seen so far) for `patience` consecutive steps. `factor: null` disables the rule.
The loss of a step is its per-token training loss, the mean over the step's accumulated
micro-batches: every rule counts optimizer steps, with or without gradient accumulation. With
optim.z_loss it is the label-smoothed loss without the z part (lit_module.training_step's
`token_loss`): the rules watch the same quantity with or without it.

On divergence the callback ends the run's outcome (normlab/outcome.py) as `diverged` with
{diverged_step, last_finite_loss, divergence_reason}; train.run copies both into results.json,
skips the final scoring and returns normally (exit code 0, so multirun sweeps continue).
Validation is switched off for the rest of the run (limit_val_batches = 0), so no checkpoint is
written after the divergence: last.ckpt is the last one saved before it, with finite weights.
`diverged_step` is the 0-based global step of the offending batch (the `step` column of the
train/loss row that logger writes for it). Under DDP the decision is reduced over ranks (any
rank diverged -> all stop), so no rank waits for another in a collective.
"""
from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch

from normlab.callbacks.stall import update_loss
from normlab.config import check_number
from normlab.outcome import RunOutcome, Status

KEY = "callbacks.divergence"


def _loss_value(loss: Any) -> float | None:
    return float(loss) if isinstance(loss, torch.Tensor) else None


class DivergenceGuard(L.Callback):
    def __init__(self, factor: float | None = 2.0, patience: int = 20, after_step: int = 0,
                 outcome: RunOutcome | None = None):
        check_number(f"{KEY}.factor", factor, "a number > 1, or null to disable the explosion rule", lambda v: v > 1,
                     null=True)
        check_number(f"{KEY}.patience", patience, "an integer >= 1", lambda v: v >= 1, integer=True)
        check_number(f"{KEY}.after_step", after_step, "an integer >= 0", lambda v: v >= 0, integer=True)
        self.factor, self.patience, self.after_step = factor, patience, after_step
        self.outcome = outcome if outcome is not None else RunOutcome()  # train.run's: what the run ended as
        self.min_loss = math.inf
        self.last_finite: float | None = None
        self.above = 0
        self.bad_grad = False
        self.nonfinite = 0  # consecutive non-finite losses
        self.overflow_steps = 0  # steps the fp16 loss scaler skipped
        self._step = 0
        self._pending: list = []  # per-token losses of the current update's micro-batches

    @staticmethod
    def _scaler(trainer):
        return getattr(trainer.precision_plugin, "scaler", None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step
        self.bad_grad = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        update = update_loss(self._pending, outputs, trainer.global_step != self._step)
        if update is None and isinstance(outputs, (dict, torch.Tensor)):
            return  # within an update (gradient accumulation): the rules count optimizer steps
        loss = _loss_value(update)
        reason = None
        scaler = self._scaler(trainer)
        norm = pl_module.stats.grad_norm  # the update's, before its step (None: no step measured)
        if norm is not None and not math.isfinite(norm):  # any inf / NaN element
            # DDP has all-reduced the gradients: every rank sees the same norm
            if scaler is not None:  # an fp16 overflow: the scaler skipped this step
                self.overflow_steps += 1
            else:
                self.bad_grad = True
        if scaler is not None:
            pl_module.log("train/overflow_steps", float(self.overflow_steps), on_step=True, on_epoch=False, batch_size=1)
        if loss is None or not math.isfinite(loss):
            self.nonfinite += 1
            if scaler is None or self.nonfinite >= self.patience:
                reason = f"non-finite loss ({loss})" + (f" for {self.nonfinite} steps" if scaler is not None else "")
        elif self.bad_grad:
            reason = "non-finite gradient"
        else:
            self.nonfinite = 0
            self.last_finite = loss
            if self._step >= self.after_step and self.factor is not None:
                self.above = self.above + 1 if loss > self.factor * self.min_loss else 0
                if self.above >= self.patience:
                    reason = (f"loss explosion: {loss:.4g} > {self.factor} x lowest {self.min_loss:.4g} "
                              f"for {self.patience} steps")
            self.min_loss = min(self.min_loss, loss)
        diverged = reason is not None
        if trainer.world_size > 1:
            diverged = trainer.strategy.reduce_boolean_decision(diverged, all=False)
            reason = reason or "diverged on another rank"
        if diverged:
            self._stop(trainer, pl_module, reason)

    def _stop(self, trainer, pl_module, reason: str) -> None:
        self.outcome.end(Status.DIVERGED, diverged_step=self._step, last_finite_loss=self.last_finite,
                         divergence_reason=reason)
        trainer.limit_val_batches = 0  # no validation, hence no checkpoint, after divergence
        trainer.should_stop = True
        pl_module.print(f"training diverged at step {self._step}: {reason}")

    def state_dict(self) -> dict:
        return {"min_loss": self.min_loss, "last_finite": self.last_finite, "above": self.above,
                "nonfinite": self.nonfinite, "overflow_steps": self.overflow_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.min_loss = state_dict["min_loss"]
        self.last_finite = state_dict["last_finite"]
        self.above = state_dict["above"]
        self.nonfinite = state_dict.get("nonfinite", 0)
        self.overflow_steps = state_dict.get("overflow_steps", 0)
