"""A run that trains without learning anything about its input is a result: `status: stalled`.

The failure this records: deep post-norm at 9+9 layers (experiments/norm_depth) neither diverges
nor learns: its training loss goes flat at ~6.6 while its peers fall to ~5.7, and it decodes every
sentence to the same output. 6.53 is the lowest loss any model that ignores its input can reach on
that data, the *input-independent floor* L*:

    t̄ = the label-smoothed target distribution averaged over the training tokens
      = (1−ε)·p + ε/V           (uniform convention; p the unigram distribution of the targets)
      = (1−ε)·p + ε·(1−p)/(V−1) (fairseq convention)
    L* = −Σ_v t̄_v log t̄_v       (the smoothed cross-entropy of the best constant prediction, q = t̄)

Criterion, decided when training ends (trainer.fit returns), with `w` = window, `k` = patience:
  stalled  <=>  at least after_step + k + w steps were trained, and
                mean(loss of the last w steps) > L* − margin          (no better than ignoring the input)
                mean(loss of the w steps ending k steps earlier) − mean(last w) < min_delta
                                                                        (and no longer improving).
The loss is the training loss of each optimizer step (label-smoothed, per target token, the mean over
the step's accumulated micro-batches; windows count optimizer steps; under DDP the means
and the token counts are reduced over ranks). p is counted from the targets of the batches this run
trained on. A stalled run is scored by the loss of its valid and test passes only (no decoding:
final_test.py) and results.json gets status "stalled", `stall_loss` (the last window's
mean), `input_independent_loss` (L*) and `stall_reason`; the report counts it like a diverged run.
Off: `callbacks.stall.margin: null`.

Stopping early (`stop_after: N`, on in the study presets): the criterion is also checked every
`window` optimizer steps during training (one reduction and host read per check, none between);
once it has held at every check for N steps the run stops there, `status: stalled` with
`stall_detected_step` and `stopped_at_step`, and is scored like any stalled run. A curve that
starts falling again before then clears the detection (deep post-norm can sit on a plateau and
then learn). null: decided only when training ends, as above. While a stall is held, validation
scores the loss only (no valid/bleu logged: lit_module.decode_valid), and the best checkpoint ranks
such a validation below every decoded one (callbacks/checkpoints.py); once the detection clears,
validation decodes again. A stalled run's final valid and test passes score the loss only
(final_test.py).
"""
from __future__ import annotations

import math
from collections import deque
from pathlib import Path

import lightning as L
import torch

from normlab.callbacks.full_checkpoint import gather
from normlab.config import check_number
from normlab.outcome import RunOutcome, Status
from normlab.settings import OptimSpec

KEY = "callbacks.stall"


def input_independent_loss(counts: torch.Tensor, eps: float, convention: str = "uniform") -> float:
    """L* for target-token counts (V,), label smoothing eps with the losses.py convention."""
    counts = counts.double()
    V = counts.numel()
    p = counts / counts.sum().clamp(min=1.0)
    t = (1 - eps) * p + (eps / V if convention == "uniform" else eps * (1 - p) / (V - 1))
    return float(-(t * t.clamp(min=1e-300).log()).sum())


def is_stalled(losses: list[float], floor: float, window: int, patience: int, margin: float,
               min_delta: float) -> str | None:
    """The reason the loss curve (the steps after after_step) is a stall, else None."""
    if len(losses) < window + patience:
        return None
    last = sum(losses[-window:]) / window
    before = sum(losses[-window - patience:-patience]) / window
    if last > floor - margin and before - last < min_delta:
        # the change signed, as it went: "(-0.012 in 100 steps)", "(+0.032 in 100 steps)" (a rise
        # printed "−-0.032" before)
        return (f"train loss flat at {last:.3f} ({last - before:+.3f} in {patience} steps), above the "
                f"input-independent floor {floor:.3f} − {margin}")
    return None


def own_start(trainer) -> bool:
    """Whether fit started afresh or from this run's own checkpoint: one in the run's folder (the
    Trainer's default_root_dir, which train.run sets to it). resume= another run's checkpoint is not:
    that run's stall, restored with the guard's state, is not this run's (a stalled run resumed with
    another lr or budget trains on), now or in this run's later legs."""
    if trainer.ckpt_path is None:
        return True
    return Path(trainer.default_root_dir).resolve() in Path(trainer.ckpt_path).resolve().parents


def update_loss(pending: list, outputs, update_done: bool) -> torch.Tensor | None:
    """The per-token training loss of an optimizer step: the mean over its micro-batches (one under
    no accumulation), a 0-dim tensor (no host sync); None until the update's last micro-batch. Reads
    `token_loss` (lit_module's per-token loss under accumulation, where Lightning's `loss` is the
    accumulation-scaled summed loss), else `loss`."""
    if isinstance(outputs, dict):
        loss = outputs.get("token_loss", outputs.get("loss"))
    else:
        loss = outputs
    if isinstance(loss, torch.Tensor):
        pending.append(loss.detach().float())
    if not update_done or not pending:
        return None
    out = torch.stack(pending).mean() if len(pending) > 1 else pending[0]
    pending.clear()
    return out


class StallGuard(L.Callback):
    def __init__(self, window: int = 50, patience: int = 100, margin: float | None = 0.25,
                 min_delta: float = 0.05, after_step: int = 0, stop_after: int | None = None,
                 outcome: RunOutcome | None = None, optim: OptimSpec = OptimSpec()):
        for key, value in (("window", window), ("patience", patience)):
            check_number(f"{KEY}.{key}", value, "an integer >= 1", lambda v: v >= 1, integer=True)
        check_number(f"{KEY}.margin", margin, "a number, or null to disable the stall rule", null=True)
        check_number(f"{KEY}.min_delta", min_delta, "a number >= 0", lambda v: v >= 0)
        check_number(f"{KEY}.after_step", after_step, "an integer >= 0", lambda v: v >= 0, integer=True)
        check_number(f"{KEY}.stop_after", stop_after, "an integer >= 0, or null: never stop early", lambda v: v >= 0,
                     integer=True, null=True)
        self.stop_after = stop_after
        self.outcome = outcome if outcome is not None else RunOutcome()  # train.run's: what the run ended as
        self.detected: int | None = None  # first step of the current run of checks that found a stall
        self._checked = -1
        self._pending: list = []  # per-token losses of the current update's micro-batches
        self._start_step = -1
        self.window, self.patience, self.margin, self.min_delta = window, patience, margin, min_delta
        self.after_step = after_step
        self.floor: float | None = None  # L*, once _decide has computed it
        self.losses: deque = deque(maxlen=window + patience)  # 0-dim tensors: no device sync per step
        self.counts: torch.Tensor | None = None
        self.ended: dict | None = None  # the stall record once this guard ended the run (checkpointed)
        # L* is of the loss the run trains with: the run's label smoothing (settings.OptimSpec)
        self.smoothing, self.convention = optim.label_smoothing, optim.label_smoothing_convention

    def on_train_start(self, trainer, pl_module) -> None:
        # continued from the checkpoint written where this guard stopped the run (the leg was then
        # interrupted, e.g. while scoring): the run is still stalled there, not trained further
        if not own_start(trainer):  # its own checkpoints must not carry another run's stall on: this
            self.ended = self.detected = None  # run finds its own, at its own checks
        if self.ended is not None and self.outcome.running:
            self.outcome.end(Status.STALLED, **self.ended)
            trainer.should_stop = True
        self._hold(pl_module)  # a continued leg validates as the interrupted one would have

    def settle(self, trainer, pl_module) -> None:
        """After fit, when no callback ended the run: a continuation whose checkpoint was at the last
        step trains nothing, and Lightning then calls neither on_train_start nor on_train_end; the
        stall is what the restored record (or the restored losses and counts) say, as it was decided
        when the interrupted leg ended."""
        if not own_start(trainer):
            self.ended = None
        if self.ended is not None and self.outcome.running:
            self.outcome.end(Status.STALLED, **self.ended)
        else:
            self.on_train_end(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start_step = trainer.global_step
        if self.margin is None:
            return
        tgt = batch["tgt_out"].reshape(-1)
        if self.counts is None:
            self.counts = torch.zeros(pl_module.model_cfg.vocab_size, dtype=torch.long, device=tgt.device)
        self.counts = self.counts.to(tgt.device)  # after a resume: from the checkpoint's CPU copy, once
        # every position, padding included (no boolean mask, no bincount: both read the device back
        # on a GPU); the padding's count is dropped where the counts are used (_decide)
        self.counts.index_add_(0, tgt, torch.ones_like(tgt))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = update_loss(self._pending, outputs, trainer.global_step != self._start_step)
        if loss is None:  # within an update (gradient accumulation): wait for its last micro-batch
            return
        if self.margin is not None and trainer.global_step > self.after_step:
            self.losses.append(loss)
        step = trainer.global_step
        if (self.stop_after is None or self.margin is None or step == self._checked or step % self.window
                or len(self.losses) < self.losses.maxlen or not self.outcome.running):
            return
        self._checked = step  # once per optimizer step (accumulation calls this per micro-batch)
        stall = self._decide(trainer, pl_module)
        self.detected = None if stall is None else step if self.detected is None else self.detected
        self._hold(pl_module)
        if stall is None:
            return
        if step - self.detected >= self.stop_after:
            self._mark(pl_module, dict(stall, stall_detected_step=self.detected, stopped_at_step=step))
            trainer.should_stop = True

    def _hold(self, pl_module) -> None:
        """Validation scores the loss only while a stall is held (found and not cleared, or the run
        ended by it): decoding a model at its floor takes minutes for a BLEU of 0 (issue 21). The
        checks run in on_train_batch_end, before Lightning's validation of the same step."""
        pl_module.hold_stall(self.detected is not None or self.ended is not None)

    def _floor(self, trainer, pl_module, reduce: bool = True) -> float:
        """L* of the targets trained on so far (one reduction over ranks: every rank calls it; without,
        this rank's targets); kept for results.json's input_independent_loss on every run (a screen
        reads its rungs against it)."""
        counts = trainer.strategy.reduce(self.counts.double(), reduce_op="sum") if reduce else self.counts.double()
        counts[pl_module.model_cfg.pad_id] = 0  # target tokens only
        self.floor = input_independent_loss(counts.cpu(), self.smoothing, self.convention)
        return self.floor

    def _decide(self, trainer, pl_module) -> dict | None:
        """The stall record if the criterion holds now (one reduction over ranks), else None."""
        floor = self._floor(trainer, pl_module)
        losses = trainer.strategy.reduce(torch.stack(list(self.losses)), reduce_op="mean").tolist() if self.losses else []
        reason = is_stalled(losses, floor, self.window, self.patience, self.margin, self.min_delta)
        if reason and all(math.isfinite(x) for x in losses):
            return {"stall_loss": sum(losses[-self.window:]) / self.window, "input_independent_loss": floor,
                    "stall_reason": reason}
        return None

    def _mark(self, pl_module, stall: dict) -> None:
        self.ended = stall
        self._hold(pl_module)
        self.outcome.end(Status.STALLED, **stall)
        stopped = f"; stopped at step {stall['stopped_at_step']}" if "stopped_at_step" in stall else ""
        pl_module.print(f"training stalled: {stall['stall_reason']}{stopped}")

    def on_train_end(self, trainer, pl_module) -> None:
        if self.margin is None or self.counts is None:
            return
        if not self.outcome.running:  # paused (a screen's rung) or ended otherwise: its floor still recorded
            self._floor(trainer, pl_module)
            return
        stall = self._decide(trainer, pl_module)
        if stall is not None:
            self._mark(pl_module, stall)
        else:  # a stall held at the last check but not at the end (training ended between checks):
            self.detected = None  # the run completed, and its final valid pass decodes (review)
            self._hold(pl_module)

    def on_exception(self, trainer, pl_module, exception) -> None:
        """A pause after a checkpoint (a screen's rung) ends fit by an exception, without on_train_end:
        the floor of this rank's targets (no collective: another rank may not be here)."""
        if self.margin is not None and self.counts is not None and self.floor is None:
            self._floor(trainer, pl_module, reduce=False)

    def state_dict(self) -> dict:
        return {"losses": [float(x) for x in self.losses],
                "counts": None if self.counts is None else self.counts.cpu(), "detected": self.detected,
                "ended": self.ended}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # The token counts are this rank's, and a checkpoint holds rank 0's callback state: every
        # rank's counts go in beside it (one gather; every rank saves), so that a continued DDP run
        # sums the counts an uninterrupted one sums (L*, results.json's input_independent_loss)
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is not None:  # one process too: resumed on N ranks, rank 0 alone takes them (not every rank)
            state["counts_by_rank"] = gather(None if self.counts is None else self.counts.cpu(), trainer.world_size)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._rank = (trainer.global_rank, trainer.world_size)  # Lightning calls load_state_dict next

    def load_state_dict(self, state: dict) -> None:
        self.losses.extend(torch.tensor(x) for x in state.get("losses", []))
        self.counts = own_counts(state, *getattr(self, "_rank", (0, 1)))
        self.detected = state.get("detected")
        self.ended = state.get("ended")


def own_counts(state: dict, rank: int, world_size: int) -> torch.Tensor | None:
    """This rank's token counts from a checkpoint's state: its own where the checkpoint has every
    rank's for this many ranks; else all of them on rank 0 (the sum over ranks is what L* reads), or,
    from a checkpoint of before the counts of every rank were kept, rank 0's on every rank (as then)."""
    by_rank = state.get("counts_by_rank")
    if by_rank is None:
        return state.get("counts")
    if len(by_rank) == world_size:
        return by_rank[rank]
    kept = [c for c in by_rank if c is not None]
    return torch.stack(kept).sum(0) if rank == 0 and kept else None
