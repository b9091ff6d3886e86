"""The final passes' direct path (final_test.py): a checkpoint's weights into the module, a split's
batches through the module's evaluation step outside Lightning's loops, the scores to the loggers.

It does what trainer.validate / trainer.test(ckpt_path=...) did, where it bears on a score:
- weights: read by the strategy's checkpoint plugin (AtomicCheckpointIO, so
  normlab.checkpoint.load_checkpoint: weights only, a checkpoint that would run code is refused),
  then the module's on_load_checkpoint and its state_dict, strictly;
- batches: the data module's valid / test loader, cut to trainer.limit_val_batches /
  limit_test_batches as Lightning counts them (fast_dev_run and overfit_batches set those limits);
- the module in eval mode on the strategy's device, no autograd, under the precision plugin's
  val / test step context; batches moved by the strategy;
- DDP: each rank scores its own shard, the loader the data module builds for that rank
  (TokenBatchSampler shards itself into equal batch counts; Lightning used the same loader, with
  use_distributed_sampler=false), and Seq2SeqModule.split_result sums the losses and gathers the
  hypotheses over the ranks, so every rank holds the whole split's scores (as validation does);
- logging: every logger at the step training ended on, with the epoch, as Lightning logs an
  evaluation's metrics outside fit (its value now the exact float results.json has, not float32);
- SIGTERM (a study stopping, a cluster preempting) or SIGUSR1 (SLURM's time-limit warning) ends
  the passes (signals_interrupt, which train.run holds from the end of fit on): the signal goes on
  to the processes the strategy launched (DDP ranks) and signals.Signalled (a SystemExit, 128 +
  signal) leaves the passes; train.run records the run `interrupted` in results.json, then hands
  the signal over as preemption does
  (signals.hand_over: the handler installed before, e.g. submitit's, else on SLURM a requeue for
  SIGUSR1) and exits 128 + signal; the same command scores the run (under trainer.test,
  Lightning's signal handler stopped its loop at the next batch);
- progress: Lightning's loops showed a bar; here, a line in the run's log (rank 0) after a batch
  that completes another tenth of the pass or ends 30 s or more after the previous line
  (PassProgress), e.g. `final test (best-step2000.ckpt): batch 12/40, 45 s`, for a pass expected to
  take 30 s or more: a shorter one shows its score line alone (the progress lines were 24 of a short
  run's 46 lines).
Callbacks are not called: a pass changes no callback's state (the run's counters, its best
checkpoint's bookkeeping stay the run's, not the loaded checkpoint's).
"""
from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from normlab.config import ConfigError
from normlab.signals import SIGNALS, Signalled

log = logging.getLogger("normlab")
PROGRESS_SECONDS = 30.0  # a progress line at least this often (at a batch's end), besides every tenth; and
# the shortest pass that has any: one expected to end sooner needs no sign that it is moving


def clock() -> float:
    return time.monotonic()


def load_weights(trainer, module, ckpt: str) -> None:
    """The checkpoint's weights into `module`, loaded as Lightning loads `ckpt_path` (its
    _CheckpointConnector.restore_model), through the same checkpoint plugin."""
    checkpoint = trainer.strategy.load_checkpoint(ckpt)
    module.on_load_checkpoint(checkpoint)
    trainer.strategy.load_model_state_dict(checkpoint, strict=module.strict_loading)


def num_batches(length: int, limit: int | float, split: str) -> int:
    """How many of a loader's `length` batches Lightning's evaluation loop runs for limit_*_batches
    `limit`: an int is a count, a float a fraction (rounded down, never to 0 of a non-empty loader)."""
    if isinstance(limit, int):
        return min(length, limit)
    n = int(length * limit)
    if n == 0 and limit > 0 and length > 0:
        name = "limit_val_batches" if split == "valid" else "limit_test_batches"
        raise ConfigError(f"trainer.{name}={limit} of {length} {split} batches is none; "
                          f"use at least {1.0 / length:.4g} or a number of batches")
    return n


@contextmanager
def evaluating(trainer, module, split: str) -> Iterator[None]:
    """The module in eval mode on the strategy's device, without autograd, in the precision
    plugin's context for the split; its train/eval mode is restored afterwards."""
    precision = trainer.precision_plugin
    context = precision.val_step_context if split == "valid" else precision.test_step_context
    was_training = module.training
    module.to(trainer.strategy.root_device)
    module.eval()
    try:
        with torch.no_grad(), context():
            yield
    finally:
        module.train(was_training)


class PassProgress:
    """`<label>: batch i/n, s s` in the run's log after batch i of a pass's n when it completes
    another tenth of the pass (so batch n ends each pass) or ends PROGRESS_SECONDS or more after the
    previous line; s: seconds since the pass began. Only once the pass is expected to take
    PROGRESS_SECONDS or more (its time per batch so far times n, known from the first batch on);
    a tenth passed before that is shown by the first line after it. Rank 0 only; it reads the clock,
    nothing else."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.enabled = label, total, enabled
        self.start = self.last_time = clock()
        self.last_tenth = 0

    def batch_done(self, done: int) -> None:
        if not self.enabled:
            return
        now, tenth = clock(), done * 10 // self.total
        expected = (now - self.start) / done * self.total
        if expected < PROGRESS_SECONDS:
            return
        if tenth > self.last_tenth or now - self.last_time >= PROGRESS_SECONDS:
            log.info("%s: batch %d/%d, %d s", self.label, done, self.total, now - self.start)
            self.last_tenth, self.last_time = tenth, now


def score_split(trainer, module, dm, split: str, decode=None, label: str | None = None, loss_only: bool = False
                ) -> tuple[dict[str, float], dict] | None:
    """(metrics, result) of the module's current weights on `split` (Seq2SeqModule.split_result),
    decoded with `decode` or the split's own decoder; None when the limit leaves no batch to run
    (Lightning skips such a loop). Progress lines are labelled `label` (default `final <split>`);
    `loss_only`: no decoding (the teacher-forced loss, nll, ppl only)."""
    loader = dm.val_dataloader() if split == "valid" else dm.test_dataloader()
    limit = trainer.limit_val_batches if split == "valid" else trainer.limit_test_batches
    n = num_batches(len(loader), limit, split)
    if n == 0:
        return None
    decode = None if loss_only else decode or module.decoder(split)
    module.reset_eval()
    progress = PassProgress(label or f"final {split}", n, trainer.is_global_zero)
    with evaluating(trainer, module, split):
        for i, batch in enumerate(itertools.islice(loader, n), 1):
            module.eval_step(trainer.strategy.batch_to_device(batch), decode)
            progress.batch_done(i)
    return module.split_result(split)


def log_metrics(trainer, metrics: dict[str, float]) -> None:
    """To every logger, as Lightning's logger connector logs metrics outside a training step: with
    the epoch, at the step training ended on; written out at once."""
    if not trainer.is_global_zero:
        return  # Lightning's loggers write from rank 0 only
    for logger in trainer.loggers:
        logger.log_metrics({**metrics, "epoch": trainer.current_epoch}, step=trainer.global_step)
        logger.save()


@contextmanager
def signals_interrupt(trainer) -> Iterator[None]:
    """Within: SIGTERM or SIGUSR1 is passed on to the strategy's launched processes and raises
    signals.Signalled(signum, the handler installed before) here (the main thread only); a second
    signal while it unwinds is ignored. train.run hands it over once results.json is written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before: dict[int, Any] = {}

    def stop(signum: int, frame) -> None:
        if caught:  # already stopping
            return
        caught.append(signum)
        launcher = trainer.strategy.launcher
        if launcher is not None:
            launcher.kill(signum)
        raise Signalled(signum, before.get(signum))

    try:
        for s in SIGNALS.values():
            before[s] = signal.signal(s, stop)
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
