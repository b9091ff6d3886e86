"""Skipping an update whose gradient norm spikes (optim.skip_spikes, issue 38).

The rule: the update at step t is skipped when its global gradient norm g_t (before clipping, of the
update's normalised gradient: lit_module.configure_gradient_clipping measures it once) exceeds

    k × median(g_{t-N}, ..., g_{t-1})          k = optim.skip_spikes, N = optim.spike_window

and nothing is skipped before the window holds N norms. A skipped update drops every gradient before
optimizer.step, so the weights, the optimizer's moments and its own step count (Adam's bias
correction) stay as they were. The learning-rate schedule still advances: it is a function of the
step number, so a run with skips and one without are at the same rate at the same step and the
budget in steps is unchanged. OLMo-core does the same: its SkipStepAdamW multiplies the update by a
0/1 step factor inside the optimizer, while the Trainer's global step, from which its scheduler sets
each step's rate, counts the skipped step too.

Every finite norm enters the window, a skipped one too, as OLMo-core's SkipStepOptimizer keeps each
step's norm in its rolling window: a lasting rise of the gradient's scale then lifts the median after
N/2 updates, where a window of accepted norms only would skip every update from then on. The median
rather than OLMo-core's mean + 6σ: a spike in the window moves the median by one rank, not the mean
and σ by its size. Non-finite norms never enter it (the divergence guard's, or fp16's loss scaler's).
"""
from __future__ import annotations

import statistics
from collections import deque

STEPS_KEPT = 100  # results.json's skipped_steps: the first this many (skipped_updates counts them all)


class SpikeGate:
    """The window of the last `window` norms and the record of the updates skipped."""

    def __init__(self, k: float, window: int):
        self.k, self.window = float(k), int(window)
        self.norms: deque[float] = deque(maxlen=self.window)
        self.skipped = 0
        self.steps: list[int] = []

    def skip(self, norm: float, step: int) -> bool:
        """Whether the update at 0-based `step` with finite gradient norm `norm` is skipped; `norm`
        enters the window either way."""
        spike = len(self.norms) == self.window and norm > self.k * statistics.median(self.norms)
        self.norms.append(norm)
        if spike:
            self.skipped += 1
            if len(self.steps) < STEPS_KEPT:
                self.steps.append(step)
        return spike

    def record(self) -> dict:
        """results.json's keys: the count and the steps (the first STEPS_KEPT)."""
        return {"skipped_updates": self.skipped, "skipped_steps": list(self.steps)}

    def state_dict(self) -> dict:
        return {"norms": list(self.norms), "skipped": self.skipped, "steps": list(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        self.norms.clear()
        self.norms.extend(float(x) for x in state.get("norms", []))  # the last `window` of them
        self.skipped = int(state.get("skipped", 0))
        self.steps = [int(s) for s in state.get("steps", [])]
