"""SIGTERM / SIGUSR1 -> a full checkpoint at the next step boundary, then stop (and requeue on SLURM).

SLURM sends SIGUSR1 before a job's time limit (`--signal=USR1@120`, what submitit's
`signal_delay_s` sets) and SIGTERM when it preempts or cancels a job. The handler only records the
signal: the checkpoint is written by FullStateCheckpoint after the current optimizer step (after
validation if one is due), never from inside the handler, where the step would be half done and
the continuation could not be exact. Then training stops, train.run writes results.json with
status "preempted" and calls `after_run()`, which hands the signal over (normlab/signals.py, the
same function the final passes use for a signal that stops them):
- if a handler was installed before ours (submitit's, which resubmits the job), it gets the signal;
- else on SLURM, SIGUSR1 requeues the job (`scontrol requeue`, as Lightning's SLURMEnvironment
  does); SIGTERM does not (SLURM requeues preempted jobs itself when the partition says so);
- then the process exits with 128 + signal (a sweep does not go on to its next job).
The requeued job runs the same command, so it lands in the same run folder and continues there.
Under DDP the ranks agree every `sync_every_n_steps` steps (one tiny all-reduce) on whether any of
them was signalled, so they all save and stop at the same step.
A signal that comes after the last step's check (during the validation or the checkpoint of the
last step, or between two DDP syncs) ends the run the same way when training ends (on_train_end,
then `after_fit` for one during Lightning's teardown): `preempted` with a checkpoint of the last
step and no final passes, which the rerun then runs (issue 37: the final scoring had gone on for
minutes after a SIGTERM in the last step; a job has seconds before SIGKILL follows).
The handler is the process's from the callback's `setup` (before Lightning installs its own, which
it then keeps and puts back at its teardown) until train.run has written results.json (`release`):
a signal after Lightning's teardown, or while results.json is written, is recorded like any other
and handed over once the record is on disk (was: it met the default action there, which killed the
run with no results.json, or a half-done record's handler).

`trainer.max_time` (a cap on one invocation) takes the same path when train.run gives it here, in
seconds, at construction (`max_time`): at the first step boundary past it, a full checkpoint, then
the run ends with status "stopped" (stopped_by: max_time) and exit 0, and rerunning the same
command continues exactly.
(Lightning's Timer stopped through `should_stop`: between micro-batches of an update, and with a
validation off the schedule, so the continuation differed from an uninterrupted run.)

`stop_at_step: N` (a rung of a study's screen, issue 36: successive halving) is a pause of the same
kind at a given step: the validation due at step N runs, a full checkpoint is written, the run ends
"stopped" (stopped_by: stop_at_step) and the same command without it, or with a later step, continues
exactly as if it had never stopped. It is not part of the run's identity (callbacks.preemption is
not), so a screened setting continued to the full budget is the run trained straight through.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import lightning as L
import torch

from normlab.callbacks.full_checkpoint import FullStateCheckpoint
from normlab.config import ConfigError
from normlab.outcome import RunOutcome, Status
from normlab.private_api import should_accumulate
from normlab.signals import SIGNALS, hand_over

log = logging.getLogger("normlab")


def clock() -> float:
    return time.monotonic()


def max_time_seconds(value: Any) -> float:
    """trainer.max_time as Lightning takes it: "DD:HH:MM:SS" or {days, hours, minutes, seconds}."""
    if hasattr(value, "keys"):
        return float(sum(float(value.get(k, 0) or 0) * m for k, m in
                         (("days", 86400), ("hours", 3600), ("minutes", 60), ("seconds", 1))))
    d, h, m, sec = (int(x) for x in str(value).split(":"))
    return float(((d * 24 + h) * 60 + m) * 60 + sec)


class Preemption(L.Callback):
    def __init__(self, signals: tuple[str, ...] | list[str] = ("SIGTERM", "SIGUSR1"), requeue: bool = True,
                 sync_every_n_steps: int = 10, stop_at_step: int | None = None, outcome: RunOutcome | None = None,
                 max_time: float | None = None):
        unknown = [s for s in signals if s not in SIGNALS]
        if unknown:
            raise ConfigError(f"callbacks.preemption.signals: {unknown[0]!r} is not valid; allowed: {', '.join(SIGNALS)}")
        if stop_at_step is not None and (isinstance(stop_at_step, bool) or not isinstance(stop_at_step, int)
                                         or stop_at_step < 1):
            raise ConfigError(f"callbacks.preemption.stop_at_step={stop_at_step!r} must be a positive number of "
                              "optimizer steps (or null: train to trainer.max_steps)")
        self.stop_at_step = stop_at_step
        self.signals = [SIGNALS[s] for s in signals]
        self.requeue, self.sync_every = requeue, max(int(sync_every_n_steps), 1)
        self.received: int | None = None
        self.outcome = outcome if outcome is not None else RunOutcome()  # train.run's: what the run ended as
        self._replaced: dict[int, Any] = {}  # the handlers ours replace during training (Lightning's)
        self._before: dict[int, Any] = {}  # the handlers from before the run (e.g. submitit's)
        self._installed = False  # ours over Lightning's, during training
        self._training = False
        self._released: dict[int, Any] = {}  # _before, once release() has put them back
        self.max_time = max_time  # seconds of training in this invocation (trainer.max_time, given by train.run)
        self._deadline: float | None = None

    # ---- the handler: record only ------------------------------------------------------------
    def _handler(self, signum: int, frame) -> None:
        then = ("checkpoint at the end of this step, then stop" if self._training
                else "the run stops once its results are recorded")
        log.info("received %s: %s", signal.Signals(signum).name, then)
        if self.received is None:
            self.received = signum

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        # Before Lightning registers its handlers (Trainer._run: setup hooks, restore, then
        # register): Lightning keeps ours as the handlers it found and puts them back at its
        # teardown, so ours hold from here to `release` (the module docstring).
        if stage != "fit" or self._before or threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            self._before[s] = signal.signal(s, self._handler)

    def release(self) -> None:
        """train.run, once results.json is written (whatever the run ended as): the handlers from
        before the run are back; a signal recorded until now is still handed over by `after_run`."""
        before, self._before = self._before, {}
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._released = before

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if self.stop_at_step is not None and self.stop_at_step <= trainer.global_step < trainer.max_steps:
            # continued from a checkpoint at or past the step: nothing to train in this invocation
            self._pause(trainer, "stop_at_step", save=False)
        if self.max_time is not None:
            self._deadline = clock() + self.max_time
        self._training = True
        # after Lightning's own handlers (registered just before), which ours replace during training
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            self._replaced[s] = signal.signal(s, self._handler)
        self._installed = True

    def _uninstall(self) -> None:
        if self._installed:
            for s, h in self._replaced.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            self._installed = False

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        # A signal that came after the last step's check (during its validation or the last save, or
        # between two DDP syncs) is recorded and nothing acts on it: it ends the run here, preempted
        # as at a step boundary, and FullStateCheckpoint, after this, saves the last step (was: the
        # run was scored in full, minutes after SIGTERM, issue 37). Ours stays installed: Lightning's
        # teardown, after the train-end hooks, puts back the handlers from before fit, ours (setup).
        self._installed, self._training = False, False
        if trainer.world_size > 1:  # every rank calls this once: all of them end alike
            flag = torch.tensor([float(self.received or 0)], device=pl_module.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            self.received = int(flag[0].item()) or None
        if self._late():
            self._save_and_stop(trainer)

    def after_fit(self, trainer: L.Trainer) -> None:
        """train.run, once fit has returned: a signal recorded after on_train_end (the last save,
        Lightning's teardown) also ends the run preempted, not scored; the ranks the strategy
        launched get it too, or they would wait in the final passes for this one. A SIGTERM that
        Lightning's own handler took (a fit with nothing left to train never installs ours) counts."""
        if self.received is None and trainer.received_sigterm:
            self.received = signal.SIGTERM
        if self._late() and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(self.received)

    def _late(self) -> bool:
        """A signal recorded and not yet acted on ends the run `preempted` (the rerun continues from
        the checkpoint of the last step and scores it); True if it did."""
        if self.received is None or not self.outcome.running:
            return False
        name = signal.Signals(self.received).name
        log.info("%s after the last step: no final passes; rerun the same command to score the run", name)
        self.outcome.end(Status.PREEMPTED, stopped_by=name)
        return True

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self._uninstall()
        self._training = False

    # ---- the decision, at a step boundary (before FullStateCheckpoint looks at it) -------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if (self.stop_at_step is not None and self.stop_at_step <= trainer.global_step < trainer.max_steps
                and self.outcome.running and not should_accumulate(trainer)):  # (at max_steps: completed)
            self._pause(trainer, "stop_at_step")  # the step count is the same on every rank: no sync
            return
        late = self._deadline is not None and clock() >= self._deadline
        if trainer.world_size > 1:
            if trainer.global_step % self.sync_every != 0:
                return
            flag = torch.tensor([float(self.received or 0), float(late)], device=pl_module.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            self.received, late = int(flag[0].item()) or None, bool(flag[1].item())
        if self.received is None and not late:
            return
        if self.received is None:  # max_time: a pause, not a preemption (no requeue, exit 0)
            self._deadline = None
            self._pause(trainer, "max_time")
        else:
            self.outcome.end(Status.PREEMPTED, stopped_by=signal.Signals(self.received).name)
            self._save_and_stop(trainer)

    def _pause(self, trainer: L.Trainer, by: str, save: bool = True) -> None:
        """End the run `stopped` (a pause: the same command continues it), after a full checkpoint
        unless the run is already at its checkpoint's step."""
        self.outcome.end(Status.STOPPED, stopped_by=by)
        if save:
            self._save_and_stop(trainer)
        else:
            trainer.should_stop = True
            trainer.limit_val_batches = 0

    @staticmethod
    def _save_and_stop(trainer: L.Trainer) -> None:
        full = next((c for c in trainer.callbacks if isinstance(c, FullStateCheckpoint)), None)
        if full is None:  # nothing to save with: stop at once
            trainer.should_stop = True
            trainer.limit_val_batches = 0
        else:
            full.stop_after_save = True

    # ---- after train.run has written results.json ------------------------------------------------
    def handler_before(self, signum: int) -> Any:
        """The handler this run found for `signum` (submitit's, the default), which it hands over to."""
        return {**self._released, **self._before}.get(signum)

    def after_run(self) -> None:
        if self.received is not None:  # the previous handler, or a requeue on SLURM; then exit
            hand_over(self.received, self.handler_before(self.received), self.requeue)
