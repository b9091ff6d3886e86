"""The pause of a rerun at a record's own code (study/verify.py) when that code predates
`callbacks.preemption.stop_at_step`: after optimizer step N the run sends itself SIGTERM, which its
preemption callback (conf/callbacks/preemption.yaml, in every commit a record names) turns into a
checkpoint at the end of the step and a stop, status "preempted", exit 143: the steps before it ran
as they do in an uninterrupted run, which is what a record's first steps are compared with.

verify copies this file beside the old code as the top-level module `normlab_verify_pause` (the old
code's `normlab` package is the one on the path), so it imports nothing of normlab.
"""
from __future__ import annotations

import os
import signal

import lightning as L


class PauseAt(L.Callback):
    def __init__(self, step: int):
        self.step, self.sent = int(step), False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # global_step counts the optimizer steps done; the preemption callback acts at this step's
        # end or, if it ran before this one, at the next one's: at least N steps either way
        if not self.sent and trainer.global_step >= self.step:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
