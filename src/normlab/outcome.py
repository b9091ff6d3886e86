"""What a run ended as: one status vocabulary for results.json, W&B, the console, the report and
`normlab-study`, and the object that carries it up from the callbacks.

`train.run` owns one `RunOutcome` and hands it to the callbacks that can end a run (the divergence
guard, the stall guard, preemption / max_time) when it builds them (`callbacks.instantiate_callbacks`
passes it to every callback whose constructor takes `outcome`). A callback ends the run by
`outcome.end(Status.X, **reasons)`; train.run reads the status and the reasons back from the object
it built (the LightningModule carries none of it).

    running      training, no callback has ended the run (never in a finished results.json but for
                 a process killed mid-run, see `interrupted`)
    completed    trained every planned step (or the data's end), scored
    stopped      trainer.max_time reached: a full checkpoint, the same command continues and scores it
    preempted    SIGTERM / SIGUSR1: a full checkpoint, the same command continues; not scored
    diverged     non-finite or exploding loss (callbacks/divergence.py): a result, not trained again
    stalled      at the input-independent floor (callbacks/stall.py): a result, scored, not trained again
    failed       an exception (failure.py adds the traceback)
    interrupted  Ctrl-C, an exception Lightning swallowed, or SIGTERM / SIGUSR1 during the final
                 passes (scoring.signals_interrupt): not a result; the same command scores a trained run
    debug        a debug=... run: never a finished run, the same command runs it again
"""
from __future__ import annotations

from enum import Enum
from typing import Any


class Status(str, Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    DIVERGED = "diverged"
    STALLED = "stalled"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    DEBUG = "debug"

    def __str__(self) -> str:  # "completed", in f-strings and str() alike (not "Status.COMPLETED")
        return self.value

    __format__ = str.__format__
    __hash__ = str.__hash__  # a member and its value are one dict key (Enum hashes the name)


def _values(*statuses: Status) -> tuple[str, ...]:
    return tuple(s.value for s in statuses)


# The lists below hold the values (plain strings, as results.json and W&B hold them); a Status is
# equal to its value, so `status in SCORED` works for either.
# Results: a rerun of the same command skips these (run_folder, study runner) and the report and
# the claims count them (a diverged or stalled arm is a finding).
FINISHED = _values(Status.COMPLETED, Status.DIVERGED, Status.STALLED)
# Paused with a full checkpoint: the same command continues them.
UNFINISHED = _values(Status.STOPPED, Status.PREEMPTED)
# The final passes score these: a stalled run is a result too. A stopped (max_time) run is not: its
# invocation's time is up, and the same command continues it and scores it at its end.
SCORED = _values(Status.COMPLETED, Status.STALLED)
# A finished run that failed to train: shown with its status, never with a score.
FAILED_TO_TRAIN = _values(Status.DIVERGED, Status.STALLED)
# results.json keys that say why a leg ended; a continued run's last leg drops an earlier leg's
# (loggers.finish_loggers removes them from the W&B summary, which outlives the legs)
REASON_KEYS = ("stopped_by", "diverged_step", "last_finite_loss", "divergence_reason", "stall_loss",
               "input_independent_loss", "stall_reason", "stall_detected_step", "stopped_at_step", "error",
               "traceback")


class RunOutcome:
    # A plain class, not a dataclass: Hydra's instantiate passes it to the callbacks as this one
    # object (a dataclass argument would be turned into a config, a copy).
    def __init__(self) -> None:
        self.status = Status.RUNNING
        self.reasons: dict[str, Any] = {}  # diverged_step, stall_reason, stopped_by, ...

    @property
    def running(self) -> bool:
        return self.status is Status.RUNNING

    def end(self, status: Status, **reasons: Any) -> None:
        """A callback ends the run. The last call wins, in the callbacks' order
        (conf/callbacks/default.yaml): a signal in the step a divergence is found ends the run as
        preempted, with the divergence's reasons kept beside it, as before there was an outcome."""
        self.status = Status(status)
        self.reasons.update(reasons)
