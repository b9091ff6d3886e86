"""Full-state checkpoints every N optimizer steps, so a killed run continues exactly.

`checkpoints/full-step<N>.ckpt` (the newest `keep` of them) hold everything the next step depends
on: Lightning's own state (weights, optimizer, LR schedule, loop counters, the train loader's
epoch and position from TokenBatchSampler, callback states: divergence guard, DropHead, the best
and step checkpoints' bookkeeping, the fp16 loss scaler) and, added here, every RNG of every rank
(torch, CUDA, numpy, Python; LayerDrop's generator counter is a buffer of the model) and the run's
counters (target tokens, training seconds, wall seconds), so throughput and wall time in
results.json cover the whole run, not the last leg; and the code of each leg (`code_legs`: the
normlab commit that trained from which step, provenance.py), so a run continued after a code change
says which code trained which steps.

When it is saved matters for exactness:
- after an optimizer step (never between the micro-batches of gradient accumulation);
- at a step where validation is due, after validation and after the best / last checkpoints have
  been updated (a checkpoint written before it would make Lightning skip that validation on
  resume, and the best checkpoint could differ);
- once more when training ends, so a run killed during its final test does not train again.
On a preemption request the run stops at the start of the next batch (StopAfterCheckpoint).
Loggers are flushed with each save, so the CSV history up to the checkpoint is on disk.
"""
from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Checkpoint

from normlab.config import ConfigError
from normlab.hardware import cpu_seconds
from normlab.private_api import should_accumulate, validation_due
from normlab.provenance import code_legs
from normlab.run_folder import FULL_PREFIX, full_checkpoints  # its files' names (Lightning-free: normlab-runs)

log = logging.getLogger("normlab")
# every_n_steps 0 (the debug presets: a debug run starts again anyway) keeps a run from continuing
NO_CONTINUATION = ("callbacks.full_checkpoint.every_n_steps=0: no full-state checkpoints, so a run killed before "
                   "its end trains again from step 0 (a preemption signal still writes one; README, \"Runs that "
                   "survive\")")


class StopAfterCheckpoint(Exception):
    """Raised at the start of the batch after a requested checkpoint (preemption): training ends
    there, with everything up to the checkpoint logged exactly as an uninterrupted run logs it
    (Lightning's `should_stop` would log one extra row at the stop)."""


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain numbers (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather(obj: Any, world_size: int) -> list:
    """`obj` of every rank, in rank order (one collective: every rank calls it)."""
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        out: list = [None] * world_size
        dist.all_gather_object(out, obj)
        return out
    return [obj]


class FullStateCheckpoint(Checkpoint):
    def __init__(self, every_n_steps: int | None = 200, keep: int = 2, started: float | None = None,
                 code: dict | None = None):
        # 0 / null: no periodic or final checkpoint (debug runs); a preemption signal still saves one
        every_n_steps = every_n_steps or 0
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ConfigError(f"callbacks.full_checkpoint.every_n_steps={every_n_steps!r} must be a positive integer "
                              "(or 0: none)")
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"callbacks.full_checkpoint.keep={keep!r} must be a positive integer")
        self.every, self.keep = every_n_steps, keep
        self.dirpath: Path | None = None  # <run dir>/checkpoints (the Trainer's default_root_dir), at setup
        # the run's start (train.run gives its own: wall time includes data loading), else now
        self.started = time.time() if started is None else started
        self.wall_before = 0.0  # wall seconds of the earlier legs of this run (from the checkpoint)
        self.cpu_started = cpu_seconds()  # this process's CPU time so far (another run's, in a test)
        self.cpu_before: float | None = 0.0  # CPU seconds of the earlier legs (None: a leg did not count them)
        self.stop_after_save = False  # set by the preemption callback: save at the next safe point, stop
        self._pending = False  # a save deferred to the end of this step's validation
        self._stop = False  # saved for a stop: end at the next batch
        self._last_step = -1
        self._rng_to_restore: dict | None = None
        self.code = code  # this leg's code (provenance.code_version), given by train.run on rank 0
        self.legs_before: list[dict] = []  # the code of the earlier legs (from the checkpoint)
        self._leg_start = 0  # the step this leg started from
        self.restored = False  # a checkpoint was loaded: legs_before and _leg_start are its

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"

    def wall_s(self) -> float:
        return self.wall_before + time.time() - self.started

    def cpu_s(self) -> float | None:
        """CPU seconds the run used over all its legs (issue 36: a study charges what a run used, not
        wall time x 1/jobs); None when a leg's checkpoint predates the count."""
        return None if self.cpu_before is None else self.cpu_before + cpu_seconds() - self.cpu_started

    def code_legs(self) -> list[dict]:
        """[{"from_step", "commit", "dirty"}] for every leg of the run up to now (provenance.code_legs)."""
        return code_legs(self.legs_before, self.code or {}, self._leg_start)

    # ---- when --------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or should_accumulate(trainer):
            return  # no optimizer step since the last save, or mid-accumulation
        if not (self._pending or self.stop_after_save or (self.every and step % self.every == 0)):
            return
        if validation_due(trainer):
            self._pending = True  # after validation (on_validation_end)
        else:
            self._save(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module) -> None:
        if self._pending and not trainer.sanity_checking:
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        # (stop_after_save: a signal after the last step's check, callbacks/preemption.py)
        if (self.every or self.stop_after_save) and trainer.global_step != self._last_step and trainer.global_step > 0:
            self._save(trainer)

    def _save(self, trainer: L.Trainer) -> None:
        self._pending = False
        step = trainer.global_step
        path = self.dirpath / f"{FULL_PREFIX}{step}.ckpt"
        for logger in trainer.loggers:  # the history up to this step is on disk with its state
            logger.save()
        trainer.save_checkpoint(str(path))
        self._last_step = step
        if trainer.is_global_zero:
            for _, old in full_checkpoints(self.dirpath)[self.keep:]:
                old.unlink(missing_ok=True)
        self._stop = self.stop_after_save

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if self._stop:
            raise StopAfterCheckpoint(f"stopped after {FULL_PREFIX}{self._last_step}.ckpt")

    # ---- what --------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict) -> None:
        checkpoint["normlab"] = {
            "rng": gather(rng_state(), trainer.world_size),  # one entry per rank
            **pl_module.throughput_counters(),  # train_tokens, train_seconds
            "wall_s": self.wall_s(),
            "cpu_s": self.cpu_s(),
            "code_legs": self.code_legs(),
        }

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict) -> None:
        # Called when fit continues from a checkpoint only: the final passes load a checkpoint's
        # weights without Lightning (scoring.py), so its counters never replace this run's.
        # trainer.max_time caps each invocation: the time of earlier legs does not count against it
        for key in [k for k in checkpoint.get("callbacks", {}) if str(k).startswith("Timer")]:
            del checkpoint["callbacks"][key]
        # This leg starts at the checkpoint's step (here, not only at on_train_start, which Lightning
        # skips when the checkpoint is at max_steps: a run killed while scoring, rerun).
        self._leg_start = int(checkpoint.get("global_step", 0))
        state = checkpoint.get("normlab")
        if state is None:  # a checkpoint written before full-state checkpoints existed
            log.warning("the checkpoint has no RNG state: the continuation will not be exact")
            self.restored = True  # its legs: unknown up to its step (provenance.code_legs)
            return
        pl_module.restore_throughput_counters(state["train_tokens"], state["train_seconds"])
        self.wall_before = state["wall_s"]
        self.cpu_before = state.get("cpu_s")  # absent: written before CPU time was counted
        self.legs_before = state.get("code_legs") or []  # none: provenance.code_legs names them unknown
        self.restored = True  # only now: a load that fails before this leaves train.py the legs it knows
        ranks = state["rng"]
        self._rng_to_restore = ranks[trainer.global_rank] if trainer.global_rank < len(ranks) else ranks[0]
        self._last_step = int(checkpoint.get("global_step", -1))

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        # A full checkpoint newer than the step this run starts from could not be read (the run
        # folder's newest readable one is where a continuation starts): it belongs to the abandoned
        # leg, and left in place it would count among the `keep` newest and the pruning after the next
        # save would delete a readable one in its stead.
        if trainer.is_global_zero and self.dirpath is not None:
            for step, path in full_checkpoints(self.dirpath):
                if step > trainer.global_step:
                    path.unlink(missing_ok=True)
        self._leg_start = trainer.global_step
        # RNG last, right before the first batch: nothing between here and training_step draws.
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def state_dict(self) -> dict:
        return {"every_n_steps": self.every}

    def load_state_dict(self, state_dict: dict) -> None:
        pass
