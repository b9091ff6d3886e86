"""Train to a plateau: stop when the validation loss has improved by less than `min_delta` over the
last `window` optimizer steps (plateau.py has the rule), or at trainer.max_steps, the cap (issue 35
item 2). The run ends `completed` either way and results.json says which happened:

    plateau: {"step": 1750 or null, "window": 500, "min_delta": 0.01, "cap": 8000}

step null with steps == cap: the run was still improving when the budget ran out, and a study judges
a comparison with such a run "budget-bound" (study/claims.py), not held or contradicted.

Decided at each validation (the monitored value is the one the fit loop logged, the same on every
DDP rank); the curve is kept in the callback's state, so a run killed and continued decides as the
uninterrupted one would. Off by default (`window: null`): then nothing changes and a run's identity
is as before (identity.NEUTRAL).
"""
from __future__ import annotations

import math

import lightning as L

from normlab.config import ConfigError
from normlab.plateau import plateau_step


class PlateauStop(L.Callback):
    def __init__(self, window: int | None = None, min_delta: float = 0.01, monitor: str = "valid/loss"):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError(f"callbacks.plateau.window={window!r} must be a positive number of optimizer steps "
                              "(or null: train to trainer.max_steps)")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ConfigError(f"callbacks.plateau.min_delta={min_delta!r} must be a number >= 0")
        self.window, self.min_delta, self.monitor = window, float(min_delta), monitor
        self.steps: list[int] = []
        self.values: list[float] = []
        self.reached: int | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module) -> None:
        if self.window is None or trainer.sanity_checking or self.reached is not None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        step = trainer.global_step
        if value is None or (self.steps and step <= self.steps[-1]):  # none logged, or a repeat at one step
            return
        self.steps.append(step)
        self.values.append(float(value))
        if plateau_step(self.steps, self.values, self.window, self.min_delta) == step:
            self.reached = step
            if step < trainer.max_steps:
                trainer.should_stop = True

    def summary(self, trainer: L.Trainer) -> dict | None:
        """results.json `plateau` (None when off)."""
        if self.window is None:
            return None
        return {"step": self.reached, "window": self.window, "min_delta": self.min_delta,
                "cap": trainer.max_steps if trainer.max_steps > 0 else None,
                "last_value": self.values[-1] if self.values and math.isfinite(self.values[-1]) else None}

    def state_dict(self) -> dict:
        return {"steps": list(self.steps), "values": list(self.values), "reached": self.reached}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.values = list(state.get("steps", [])), list(state.get("values", []))
        self.reached = state.get("reached")
