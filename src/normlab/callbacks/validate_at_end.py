"""Validate at the last step too, as fairseq does at the end of training.

Lightning validates every `val_check_interval` steps only, so a run whose trainer.max_steps is not
a multiple of it ends with unvalidated steps: a 600-step run with validation every 500 chose its
best checkpoint without its last 100 steps, and a 200-step run never validated at all (it was scored
with its final weights, unvalidated). At the last step, when that step is not a validation step,
this asks the Trainer to stop (its public `should_stop`), and Lightning validates a run that stops
(its training epoch loop checks `should_stop` before the interval), so the best checkpoint is
chosen among all the weights a run ends with. A run whose max_steps is a multiple of the interval
(every shipped preset and study) is untouched.
"""
from __future__ import annotations

from lightning.pytorch.callbacks import Callback


class ValidateAtEnd(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.should_stop or trainer.max_steps <= 0 or trainer.global_step < trainer.max_steps:
            return
        every = trainer.val_check_batch  # batches between validations (budget.py: steps x accumulation)
        if isinstance(every, int) and every > 0 and (trainer.global_step * trainer.accumulate_grad_batches) % every:
            trainer.should_stop = True
