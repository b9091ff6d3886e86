"""Sets the DropHead rate p before every training batch and logs it (`regularizer/drophead_p`).

The node `callbacks.drophead_schedule` (conf/callbacks/drophead_schedule.yaml) is always composed;
with `regularizer.drophead = 0` the model has no DropHead module and this callback does nothing.
Its keys: `schedule` (a name from regularizers/rate_schedules.py: constant | v_shape), `warmup`
(the V's falling leg; null -> optim.warmup, from the run's OptimSpec given at construction) and
`p_start` (null -> p).

p is a pure function of `trainer.global_step` (optimizer steps done; the schedule's step is that
+ 1, see regularizers/rate_schedules.py), so a run resumed from a checkpoint, whose global_step
Lightning restores before the first batch, continues the schedule where it stopped: the callback
keeps no state of its own (its state_dict records the last value for inspection only).
"""
from __future__ import annotations

from typing import Any

import lightning as L

from normlab.config import check_choice, check_number
from normlab.regularizers.drophead import set_drophead_p
from normlab.regularizers.rate_schedules import DEFAULT_SCHEDULE, SCHEDULES, schedule_value
from normlab.settings import OptimSpec

KEY = "callbacks.drophead_schedule"


class DropHeadSchedule(L.Callback):
    def __init__(self, p: float, schedule: str = DEFAULT_SCHEDULE, warmup: int | None = None,
                 total: int | None = None, p_start: float | None = None, optim: OptimSpec = OptimSpec()):
        check_choice(f"{KEY}.schedule", schedule, SCHEDULES)
        # rates are probabilities; p is regularizer.drophead's (checked there too, for a node built by hand)
        check_number(f"{KEY}.p", p, "a probability in [0, 1)", lambda v: 0 <= v < 1)
        check_number(f"{KEY}.p_start", p_start, "a probability in [0, 1], or null for p", lambda v: 0 <= v <= 1,
                     null=True)
        check_number(f"{KEY}.warmup", warmup, "an integer >= 0, or null for optim.warmup", lambda v: v >= 0,
                     integer=True, null=True)
        check_number(f"{KEY}.total", total, "an integer > 0, or null for trainer.max_steps", lambda v: v > 0,
                     integer=True, null=True)
        # Zhou et al. 2020 tie the V's bottom to the LR warmup: the default falling leg is optim.warmup
        self.warmup = warmup if warmup is not None else optim.warmup
        self.p, self.schedule, self.total, self.p_start = p, schedule, total, p_start
        self.last_p: float | None = None

    def value(self, global_step: int, warmup: int, total: int | None) -> float:
        return schedule_value(self.schedule, global_step + 1, self.p, total, warmup, self.p_start)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.p:
            return  # no DropHead in the model
        total = self.total if self.total is not None else (trainer.max_steps if trainer.max_steps > 0 else None)
        p = self.value(trainer.global_step, self.warmup, total)
        set_drophead_p(pl_module, p)
        self.last_p = p
        pl_module.log("regularizer/drophead_p", p, prog_bar=False, on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict:
        return {"last_p": self.last_p}

    def load_state_dict(self, state: dict) -> None:
        self.last_p = state.get("last_p")
