"""What SIGTERM / SIGUSR1 do once they have stopped a run and results.json says so: one function,
`hand_over`, for the two places a run stops on them (training: callbacks/preemption.py, whose run
ends `preempted`; the final passes: scoring.signals_interrupt, whose run ends `interrupted`).

- the handler installed before normlab's (e.g. submitit's, which resubmits the job) gets the signal;
- else on SLURM (SLURM_JOB_ID set, SLURM_PROCID 0), SIGUSR1 requeues the job (`scontrol requeue
  <job>`, as Lightning's SLURMEnvironment does); SIGTERM does not (SLURM requeues preempted jobs
  itself when the partition says so);
- then the process exits with 128 + the signal number (a sweep does not go on to its next job).
Both come after results.json is written: `scontrol requeue` ends the running job, and the requeued
job runs the same command, which reads that file to continue the run (or to score it).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from contextlib import contextmanager
from typing import Any, Iterator, NoReturn

log = logging.getLogger("normlab")
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1}  # what a cluster or a study sends to stop a job


def slurm_job_id() -> str | None:
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")
    return job if job and re.fullmatch(r"[0-9_]+", job) else None


def hand_over(signum: int, before: Any, requeue: bool = True) -> NoReturn:
    """`before` (the handler installed before normlab's) gets `signum`; else, `requeue` on and on
    SLURM's first task, SIGUSR1 requeues the job; then SystemExit(128 + signum)."""
    if callable(before):  # e.g. submitit's handler: it resubmits the job and exits
        before(signum, None)
    elif requeue and signum == signal.SIGUSR1 and (job := slurm_job_id()) is not None \
            and int(os.environ.get("SLURM_PROCID", "0")) == 0:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if result.returncode == 0:
            log.info("requeued SLURM job %s: it continues in the same run folder", job)
        else:
            log.warning("scontrol requeue %s failed: %s", job, (result.stderr or result.stdout).strip())
    raise SystemExit(128 + signum)


class Signalled(SystemExit):
    """SIGTERM / SIGUSR1 stopped the final passes (scoring.signals_interrupt): exits 128 + signum,
    and train.run, once results.json is written, calls `hand_over(signum, before)`."""

    def __init__(self, signum: int, before: Any):
        super().__init__(128 + signum)
        self.signum, self.before = signum, before


@contextmanager
def deferred(signals=(signal.SIGINT, *SIGNALS.values())) -> Iterator[None]:
    """Signals that arrive inside the block wait for its end, then go to the handlers from before it
    (re-raised, once each, in the order they came): closing the loggers after results.json is
    written (loggers.finish_loggers) is not cut off by a second SIGTERM, which is handled after it,
    as if it had come a moment later. The same signal twice inside the block is handled at once
    (a close that hangs still stops on a second Ctrl-C). Off the main thread, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    before: dict[int, Any] = {}

    def restore() -> None:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def hold(signum: int, frame) -> None:
        if signum in came:  # the same signal again: the user means it (a hung close); handled now,
            came.remove(signum)  # once: the held copy is not raised again at the end
            restore()
            signal.raise_signal(signum)
            return
        came.append(signum)

    before.update({s: signal.signal(s, hold) for s in signals})
    try:
        yield
    finally:
        restore()
        for signum in dict.fromkeys(came):
            signal.raise_signal(signum)
