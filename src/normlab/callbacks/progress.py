"""What a user watches: a fairseq-like text line every `trainer.log_every_n_steps`, and a bar.

TrainLog writes, bar on or off, to the console and train.log (the `normlab` logger, which Hydra
sends to both), averaged over the steps since the previous line, as fairseq's log_interval does:

    step 100/2000 | epoch 1 | loss 5.123 | nll 4.901 | ppl 29.87 | lr 1.20e-03 | gnorm 1.23 |
    tgt tok/s 5,123 | upd/s 2.80 | elapsed 0:01:23 | eta 0:10:00

loss / nll / ppl per target token (label-smoothed loss, NLL, e^nll), gnorm the global gradient
norm before clipping and lr the learning rate of the last step, tok/s and upd/s over wall time (data loading included, so
validation pauses are not), eta from the training time per step so far. Under DDP the sums are
reduced over ranks (one collective per line) and rank 0 writes.

StepProgressBar is Lightning's TQDM bar over the run's planned optimizer steps (not per epoch,
so no `Epoch 0/-2`), showing loss, lr and tokens/s; text lines are written above it (tqdm-aware
logging), not into it. `console_setup` removes Lightning's second console handler (its INFO lines
came twice) and drops, by message, the third-party notices a user cannot act on.
"""
from __future__ import annotations

import datetime
import logging
import math
import time
import warnings

import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar

log = logging.getLogger("normlab")

# (logger, message start) of notices a user cannot act on; filtered by message, nothing broader.
NOISE_RECORDS = (
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip:"),
    ("lightning.pytorch.utilities.rank_zero", "`Trainer(limit_val_batches=1.0)` was configured"),
    ("lightning.pytorch.utilities.rank_zero", "`Trainer(limit_test_batches=1.0)` was configured"),
    ("lightning.pytorch.utilities.rank_zero", "Restoring states from the checkpoint path at"),
    # each final pass names its checkpoint in its own line ("final test (best-step2000.ckpt): ..."), and a
    # continued run says "continuing from ... (step N)": Lightning's line would repeat it once per pass
    ("lightning.pytorch.utilities.rank_zero", "Loaded model weights from the checkpoint at"),
    # no accelerator to report on a CPU machine (a GPU machine keeps "GPU available: True (cuda), used: ...")
    ("lightning.pytorch.utilities.rank_zero", "GPU available: False"),
    ("lightning.pytorch.utilities.rank_zero", "TPU available: False"),
    # Lightning restoring its own training state (normlab's loads are weights-only, docs/decoding.md)
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", "`weights_only` was not set"),
    # the seed is in the run's name, results.json and W&B; the line came before any error line too
    ("lightning.fabric.utilities.seed", "Seed set to"),
    # the run's summary says "steps 200 of 200" (and a stop before the budget says why, in its own line)
    ("lightning.pytorch.utilities.rank_zero", "`Trainer.fit` stopped: `max_steps="),
)
NOISE_WARNINGS = (
    # Lightning's own checkpoint reads; every checkpoint normlab loads itself is weights-only
    r".*`weights_only` was not set",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning calling a torch API it will update
    r"The 'train_dataloader' does not have many workers",  # data.num_workers=0 is normlab's choice on CPU
    r"The '(val|test)_dataloader' does not have many workers",
    # resume= another run's checkpoint: its best-checkpoint record points into that run's folder, which
    # this run does not use (it validates, and keeps its own best, in its own folder)
    r"The dirpath has changed from",
)


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def console_setup() -> None:
    """One console line per record, without the notices a user cannot act on (idempotent)."""
    root = logging.getLogger()
    lightning = logging.getLogger("lightning")
    if root.handlers:  # Hydra (or the user) configured logging: Lightning's own console handler doubles it
        for h in list(lightning.handlers):
            if type(h) is logging.StreamHandler:
                lightning.removeHandler(h)
    for name in {n for n, _ in NOISE_RECORDS}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(tuple(m for n, m in NOISE_RECORDS if n == name)))
    for message in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds))) if math.isfinite(seconds) else "?"


def planned_steps(trainer) -> int | None:
    steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
    return int(steps) if math.isfinite(steps) else None


class TrainLog(Callback):
    """The text line; reads each step's (loss sum, nll sum, target tokens) from the module's
    `stats.step_sums` (lit_module.TrainStats), set by the training step without a device sync."""

    def __init__(self, every_n_steps: int | None = None):
        self.every_n_steps = every_n_steps  # None: trainer.log_every_n_steps
        self._sums: torch.Tensor | None = None  # loss, nll since the last line (on the device: no sync)
        self._ntok = 0  # target tokens since the last line (collate counts them on the host)
        self._t_start = self._t_last = time.perf_counter()
        self._start_step = self._last_step = 0
        self._eval_seconds = 0.0
        self._gnorm: float | None = None
        self._lr = float("nan")  # the last step's rate (none before the first step)

    def _every(self, trainer) -> int:
        return max(int(self.every_n_steps or trainer.log_every_n_steps or 50), 1)

    def setup(self, trainer, pl_module, stage: str) -> None:
        console_setup()

    def on_train_start(self, trainer, pl_module) -> None:
        self._t_start = self._t_last = time.perf_counter()
        self._start_step = self._last_step = trainer.global_step
        self._eval_seconds, self._sums, self._ntok = 0.0, None, 0

    def on_validation_start(self, trainer, pl_module) -> None:
        self._t_eval = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":
            self._eval_seconds += time.perf_counter() - self._t_eval

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it after)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.stats.grad_norm is not None:  # the update's, measured once by the module
            self._gnorm = pl_module.stats.grad_norm
        stats = pl_module.stats.step_sums  # (loss sum, nll sum, target tokens)
        if stats is not None:
            loss, nll, ntok = stats
            step = torch.stack([loss.detach().double(), nll.detach().double()])
            self._sums = step if self._sums is None else self._sums + step
            self._ntok += int(ntok)
        step = trainer.global_step
        if step % self._every(trainer) == 0 and step != self._last_step and self._sums is not None:
            self._write(trainer)

    def _write(self, trainer) -> None:
        ntok = torch.tensor([float(self._ntok)], dtype=torch.float64, device=self._sums.device)
        loss, nll, ntok = trainer.strategy.reduce(torch.cat([self._sums, ntok]), reduce_op="sum").tolist()
        now, step = time.perf_counter(), trainer.global_step
        interval = max(now - self._t_last, 1e-9)
        train_seconds = max(now - self._t_start - self._eval_seconds, 1e-9)
        planned = planned_steps(trainer)
        eta = (planned - step) * train_seconds / max(step - self._start_step, 1) if planned else float("nan")
        lr = self._lr
        ntok = max(ntok, 1.0)
        parts = [f"step {step}/{planned or '?'}", f"epoch {trainer.current_epoch + 1}",
                 f"loss {loss / ntok:.3f}", f"nll {nll / ntok:.3f}", f"ppl {math.exp(min(nll / ntok, 50)):.2f}",
                 f"lr {lr:.2e}", f"gnorm {self._gnorm:.3f}" if self._gnorm is not None else "gnorm ?",
                 f"tgt tok/s {ntok / interval:,.0f}", f"upd/s {(step - self._last_step) / interval:.2f}",
                 f"elapsed {_hms(now - self._t_start)}", f"eta {_hms(eta)}"]
        if trainer.is_global_zero:
            log.info(" | ".join(parts))
        self._t_last, self._last_step, self._sums, self._ntok = now, step, None, 0


class StepProgressBar(TQDMProgressBar):
    """One bar over the run's planned optimizer steps, with loss, lr and target tokens/s."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset(total=planned_steps(trainer))
        self.train_progress_bar.initial = trainer.global_step
        self.train_progress_bar.n = trainer.global_step
        self.train_progress_bar.set_description("train")

    def on_train_epoch_start(self, trainer, *_) -> None:
        self.train_progress_bar.set_description(f"train (epoch {trainer.current_epoch + 1})")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        bar = self.train_progress_bar
        # every refresh_rate steps and at the last (TQDMProgressBar's rule, on its public settings;
        # refresh_rate 0 is not enabled)
        if bar is not None and self.is_enabled and (step % self.refresh_rate == 0 or step == (bar.total or 0)):
            self.train_progress_bar.n = step
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=True)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass  # one bar for the whole run

    def init_test_tqdm(self):
        bar = super().init_test_tqdm()
        bar.leave = False  # the test lines in the log say what was scored
        return bar

    def get_metrics(self, trainer, pl_module) -> dict:
        m = trainer.progress_bar_metrics
        out = {}
        if "train/loss" in m:
            out["loss"] = f"{m['train/loss']:.3f}"
        if trainer.optimizers:
            out["lr"] = f"{trainer.optimizers[0].param_groups[0]['lr']:.2e}"
        tps = pl_module.stats.tokens_per_s
        if tps:
            out["tok/s"] = f"{tps:,.0f}"
        if "valid/bleu" in m and pl_module.decode_valid:  # not a stale one while a
            # stall is held and validation scores the loss only (callbacks/stall.py)
            out["valid bleu"] = f"{m['valid/bleu']:.2f}"
        return out

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        from tqdm.contrib.logging import logging_redirect_tqdm

        # log lines (the text line, validation scores) are written above the bar, not into it
        self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger()])
        self._redirect.__enter__()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        redirect = getattr(self, "_redirect", None)
        if redirect is not None:
            redirect.__exit__(None, None, None)
            self._redirect = None
        super().teardown(trainer, pl_module, stage)


def progress_bar(enabled: bool = True, refresh_rate: int = 1, tty_only: bool = True):
    """The bar when trainer.enable_progress_bar is true and (tty_only) stdout is a terminal, else None:
    in a file (SLURM logs, `| tee`) a bar is only noise; the text lines say everything."""
    import sys

    return StepProgressBar(refresh_rate=refresh_rate) if enabled and (sys.stdout.isatty() or not tty_only) else None
