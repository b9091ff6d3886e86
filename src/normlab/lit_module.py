"""Seq2SeqModule: the LightningModule that trains and scores a Seq2SeqTransformer.

Loss: label-smoothed cross-entropy summed over target tokens and divided by the number of
target tokens of the whole *update* (all ranks, all accumulated micro-batches), as fairseq does,
so DDP over k ranks, k accumulated micro-batches and one process on the union batch give the same
gradient. Without accumulation each step divides by the global token count directly; with it the
token count of the later micro-batches is not known at the first backward, so each micro-batch
back-propagates its summed loss and the accumulated gradient is divided by the update's token
count once, before clipping and the optimizer step (on_before_optimizer_step; fairseq's
multiply_grads).
Validation: loss, perplexity (e^nll per token) and sacreBLEU of decoded output; the final passes
(final_test.py) score the same way outside Lightning's loops. With eval.valid_subset, validation
during training decodes a fixed subset of the valid sentences (evaluation.subset_rows) while its
loss covers them all; the final valid pass decodes them all.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
import torch
import torch.distributed as dist

from normlab.config import ModelConfig
from normlab.evaluation import make_decoder, ordered, score, subset_rows, translate_batches
from normlab.losses import model_loss
from normlab.model.schemes import get_scheme
from normlab.model.transformer import Seq2SeqTransformer
from normlab.optimizers import build_optimizer
from normlab.lr_schedule import lr_factor, peak_lr
from normlab.private_api import logs_this_step
from normlab.scoring import num_batches
from normlab.settings import EvalSpec, OptimSpec
from normlab.spikes import SpikeGate
from normlab.update_gradient import distributed as _dist, gate_update, normalize_accumulated_


log = logging.getLogger("normlab")


@rank_zero_only
def rank_zero_warning(message: str) -> None:
    log.warning(message)


@rank_zero_only
def rank_zero_info(message: str) -> None:
    """normlab's own lines under normlab's logger (was Lightning's rank_zero logger), on rank 0."""
    log.info(message)


def score_line(label: str, logged: dict[str, float], result: dict) -> str:
    """`<label>: loss 5.82  ppl 326.19  bleu 0.01  chrf 0.01` (nll left out), the log's line for one pass."""
    shown = "  ".join(f"{k.split('/')[1]} {v:.2f}" for k, v in logged.items() if "nll" not in k)
    partial = f"  (partial: {result['partial']})" if "partial" in result else ""
    subset = f"  (bleu and chrf on {result['subset']})" if "subset" in result else ""
    return f"{label}: {shown}{subset}{partial}"


def adam_on_gpu(precision: str, clipping: bool) -> dict:
    """torch.optim.Adam's implementation flags for a run on CUDA at Lightning `precision`: fused unless
    clipping under mixed precision, which Lightning's MixedPrecision plugin refuses for fused Adam."""
    return {} if clipping and "mixed" in precision else {"fused": True}


@dataclass
class TrainStats:
    """What training leaves for the callbacks, a field the module declares (Seq2SeqModule.stats)
    instead of attributes found on it by name: the last step's sums (the text log line,
    callbacks/progress.py) and the throughput counters (full checkpoints carry them across legs)."""
    step_sums: tuple[torch.Tensor, torch.Tensor, int] | None = None  # the last step's (loss sum, nll sum,
    # target tokens): the loss sums on the device, read by no one here (no host sync per step)
    tokens: int = 0  # target tokens trained, over every leg of the run
    seconds: float = 0.0  # seconds in training steps, over every leg
    # optim.clip_norm > 0: the updates since the last logged step, and how many of them clipping
    # shortened; logged as train/clip_rate
    clip_steps: int = 0
    clipped: float = 0.0
    # this update's global gradient norm before clipping, on the host: measured once per update
    # (Seq2SeqModule.configure_gradient_clipping) and read by every user of it (the clip rate, clipping,
    # the spike rule, the divergence guard, the text line); None before the update's optimizer step
    grad_norm: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class Seq2SeqModule(L.LightningModule):
    def __init__(self, model_cfg: dict, optim: OptimSpec, eval: EvalSpec, tokenizer_proto: bytes | None = None,
                 compile: bool | str = False):
        super().__init__()
        # plain values only: a checkpoint is loaded weights-only, so it holds no class of ours
        self.save_hyperparameters({"model_cfg": model_cfg, "optim": optim.to_dict(), "eval": eval.to_dict(),
                                   "compile": compile})
        self.model_cfg = ModelConfig.from_dict(model_cfg)
        self.model = Seq2SeqTransformer(self.model_cfg)
        # model.compile=true: torch.compile the training forward in place (state-dict keys unchanged,
        # so checkpoints load into an uncompiled model); decoding (encode/decode) stays eager.
        # A string names the torch.compile backend (true = inductor; aot_eager to debug a failure).
        # Compilation happens in the first training step, whose time is reported as compile_seconds.
        self.compile_seconds: float | None = None
        if compile:
            self.model.compile(**({} if compile is True else {"backend": compile}))
        self.optim_spec, self.eval_spec = optim, eval
        self.tokenizer_proto = tokenizer_proto  # the sentencepiece model, so a checkpoint decodes alone
        self.decode = make_decoder(**eval.valid_decoding)
        # The final test decodes as the papers do (eval.test_decoder: beam 4) while validation
        # stays greedy; the final greedy test pass decodes with `decode` (final_test.py).
        self.test_decode = make_decoder(**eval.test_decoding)
        self.stats = TrainStats()
        # optim.skip_spikes: the window of gradient norms and the updates skipped (spikes.py); checkpointed
        self.spikes = SpikeGate(optim.skip_spikes, optim.spike_window) if optim.skip_spikes is not None else None
        self._t_batch = 0.0
        self._update_tokens = 0  # target tokens of this rank's micro-batches in the current update
        # False while the stall guard holds a stall (callbacks/stall.py): validation then scores the
        # loss only, as a model at its input-independent floor decodes to the length cap for a BLEU
        # of 0 (issue 21); the best checkpoint ranks such a validation last (callbacks/checkpoints.py)
        self.decode_valid: bool = True
        # the scores of the latest validation in this process, without its hypotheses: the final valid
        # pass reuses them when it would score the same weights (final_test.py)
        self.last_validation: dict | None = None
        self._valid_t0 = 0.0
        self.reset_eval()

    # ---- training ---------------------------------------------------------------------------
    def _loss(self, batch: dict, z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        # The output projection and the loss in row chunks: no (B, T, V) logits (losses.model_loss).
        # z_loss: training's objective only (optim.z_loss); validation and test losses never include it.
        o = self.optim_spec
        loss, nll, log_z2 = model_loss(self.model, batch["src"], batch["tgt_in"], batch["tgt_out"], o.label_smoothing,
                                       self.model_cfg.pad_id, o.label_smoothing_convention, z_loss)
        # collate counts the non-pad labels on the host: no device sync per step to read it back
        ntok = batch.get("ntokens")
        ntok = int(batch["tgt_out"].ne(self.model_cfg.pad_id).sum()) if ntok is None else int(ntok)
        return loss, nll, ntok, log_z2

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # No host syncs here (a GPU step would wait for the previous one to finish): the token count
        # comes from collate on the host, DDP reduces it on the device, and tensors are logged only
        # on the steps the logger writes (the progress bar reads logged tensors back at every step).
        z = self.optim_spec.z_loss
        loss, nll, ntok, log_z2 = self._loss(batch, z)
        n = max(ntok, 1)
        self.stats.tokens += ntok
        self.stats.step_sums = (loss.detach(), nll.detach(), ntok)
        if logs_this_step(self):  # with optim.z_loss, train/loss is the objective and train/z_loss its z part
            self.log_dict({"train/loss": loss.detach() / n, "train/nll": nll.detach() / n}, prog_bar=True,
                          batch_size=n)
            if z:
                self.log("train/z_loss", z * log_z2 / n, prog_bar=False, batch_size=n)
            self.log("train/lr", self.optimizers().param_groups[0]["lr"], prog_bar=False)
        # what the divergence and stall guards watch (`token_loss`, callbacks/stall.update_loss): the
        # label-smoothed loss without the z part, which would otherwise move their thresholds and L*
        watched = loss.detach() - z * log_z2 if z else loss.detach()
        if self._accumulation() > 1:  # summed loss; on_before_optimizer_step divides by the update's tokens
            self._update_tokens += ntok
            return {"loss": loss, "token_loss": watched / n}
        norm = float(n)
        if _dist():  # normalise by the global token count; DDP then averages over ranks
            t = torch.tensor(float(ntok), device=loss.device)
            dist.all_reduce(t)
            norm = t.clamp(min=1.0) / dist.get_world_size()
        return {"loss": loss / norm, "token_loss": watched / norm} if z else loss / norm  # as the guards read it without z

    def _attached_trainer(self):
        """The Trainer this module is attached to, or None (Lightning's public `trainer` raises then)."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    def _accumulation(self) -> int:
        trainer = self._attached_trainer()
        return int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if trainer is not None else 1

    def on_train_start(self) -> None:
        # resume= restores the lr the checkpoint's schedule set for the next update; under another schedule, warmup
        # or max_steps the run's own applies from it on, as fairseq's step_update on load (else: the same float)
        sched = self.lr_schedulers()
        if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
            groups = sched.optimizer.param_groups
            for group, base, factor in zip(groups, sched.base_lrs, sched.lr_lambdas, strict=True):
                group["lr"] = base * factor(sched.last_epoch)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Under accumulation: the gradient divided by the update's target tokens (update_gradient.py)."""
        k = self._accumulation()
        if k > 1:
            tokens, self._update_tokens = self._update_tokens, 0
            normalize_accumulated_(self.parameters(), tokens, k, self.device)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """The step, then the scheme's constraint on the weights (nGPT, Loshchilov et al. 2025: every
        matrix back to unit norm along its embedding axis; nothing for the other schemes). Here, not in a
        callback: the constraint is part of the model's definition, not an option a config could leave
        out, and this hook runs once per update (after accumulation), on every rank alike, also when the
        update was skipped or dropped (the weights are then already unit: renormalising is a no-op)."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.model.constrain_()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """The update's gradient, once, before optimizer.step (issue 38; update_gradient.gate_update: its norm,
        dropped, skipped, clipped). Lightning calls this last: after every callback's and this module's
        on_before_optimizer_step (the accumulation's normalisation) and after fp16's unscaling, so the
        norm measured here is the update's own."""
        if gate_update(optimizer, self.trainer.precision_plugin, self.stats, self.spikes, self.global_step,
                       gradient_clip_val, gradient_clip_algorithm):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._t_batch = time.perf_counter()
        self.stats.grad_norm = None  # until this update's is measured (configure_gradient_clipping)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        seconds = time.perf_counter() - self._t_batch
        self.stats.seconds += seconds
        if self.hparams.get("compile") and self.compile_seconds is None:
            self.compile_seconds = seconds
            rank_zero_info(f"model.compile: the first training step took {seconds:.1f} s (compilation included)")
        if self.stats.seconds > 0 and self.global_step % max(self.trainer.log_every_n_steps, 1) == 0:
            self.log("train/tokens_per_s", self.stats.tokens_per_s, prog_bar=False)
            if self.stats.clip_steps:  # the share of the updates since the last log that clipping shortened
                self.log("train/clip_rate", self.stats.clipped / self.stats.clip_steps, prog_bar=False)
                self.stats.clipped, self.stats.clip_steps = 0.0, 0
            if self.spikes is not None:  # the updates skipped so far (optim.skip_spikes)
                self.log("train/skipped", float(self.spikes.skipped), prog_bar=False)

    def throughput_counters(self) -> dict[str, float]:
        """The target tokens and seconds trained so far (full checkpoints carry them across legs)."""
        return {"train_tokens": self.stats.tokens, "train_seconds": self.stats.seconds}

    def restore_throughput_counters(self, train_tokens: float, train_seconds: float) -> None:
        self.stats.tokens, self.stats.seconds = train_tokens, train_seconds

    def configure_optimizers(self):
        o = self.optim_spec
        for line in get_scheme(self.model_cfg.norm.placement).optim_warnings(o):  # nGPT: no warmup, no decay
            rank_zero_warning(line)
        peak = peak_lr(self.model_cfg.d_model, o.warmup, o.lr, o.scale)
        opt = build_optimizer(self.model, o, peak, self._adam_impl())  # optim.optimizer: adam | adamw
        # LambdaLR's counter is 0 for the first optimizer step; the paper counts from 1.
        trainer = self._attached_trainer()  # cosine / linear: towards 0 by its max_steps (run_config checks it)
        self.lr_total = total = int(trainer.max_steps) if trainer is not None and trainer.max_steps > 0 else None
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(o.schedule, s + 1, o.warmup, total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _adam_impl(self) -> dict:
        # GPU: the fused kernel (one launch for every parameter, no per-step host syncs), except with
        # clipping under mixed precision (bf16-mixed as fp16-mixed): Lightning's MixedPrecision plugin
        # refuses to clip for any optimizer that could unscale inside step() (fused Adam does), so
        # there torch's default (foreach on GPU). Seen on an H100, 2026-11-27: trainer=gpu with
        # optim.clip_norm=1.0 stopped at the first step (benchmarks/README.md, GPU check). CPU: foreach, whose result is torch's
        # default per-parameter loop's bit for bit (the same ops per tensor, looped in C++; CPU's
        # fused kernel is not: tests/test_speed.py), with fewer ops called from Python (issue 21;
        # torch's Adam still reads each parameter's step with .item(), free on CPU). A resumed run
        # keeps the flags its checkpoint saved (torch's load_state_dict restores a group's options):
        # a CPU run from before this kept its loop, bit for bit the same, only slower.
        if all(p.device.type == "cpu" for p in self.parameters()):
            return {"foreach": True}
        if not all(p.device.type == "cuda" for p in self.parameters()):
            return {}
        precision = str(getattr(self._attached_trainer(), "precision", ""))
        # the spike rule reads the gradient's norm before the step too: unscaled, as clipping does
        return adam_on_gpu(precision, float(self.optim_spec.clip_norm) > 0 or self.spikes is not None)

    # ---- validation / test ----------------------------------------------------------------------
    # Validation during training runs in Lightning's loop (validation_step, on_validation_epoch_*);
    # the final passes call reset_eval / eval_step / split_result themselves (final_test.py,
    # scoring.py): one computation of every score.
    def reset_eval(self) -> None:
        self._batch_sums: dict[int, tuple[float, float, int]] = {}  # loss, nll, ntokens by batch
        self._hyps: dict[int, str] = {}
        # the sentences this pass's BLEU is over when not all: validation's subset (eval.valid_subset,
        # set by on_validation_epoch_start); the final passes, which reset here, score every sentence
        self._bleu_rows: tuple[int, ...] | None = None

    def hold_stall(self, held: bool) -> None:
        """The stall guard's word (callbacks/stall.py): while a stall is held, validation scores the loss only."""
        self.decode_valid = not held

    def decoder(self, split: str):
        """How `split` is decoded for BLEU: valid by eval.decoder (None, the loss only, when
        eval.valid_bleu is false or while a stall is held: `decode_valid`), test by eval.test_decoder."""
        if split == "valid":
            return self.decode if self.eval_spec.valid_bleu and self.decode_valid else None
        return self.test_decode

    def eval_step(self, batch: dict, decode=None) -> None:
        """Add one batch (this rank's) to the pass: its teacher-forced loss sums and, with `decode`,
        its hypotheses (evaluation.translate_batches)."""
        loss, nll, ntok, _ = self._loss(batch)
        # keyed by the batch's first sentence: under DDP each rank's shard is padded with repeats of
        # other batches (TokenBatchSampler), which must count once, as their hypotheses do
        self._batch_sums[int(batch["idx"][0])] = (loss.item(), nll.item(), ntok)
        if decode is not None:
            self._hyps.update(translate_batches(self.model, [batch], decode, self._detok))

    def _detok(self, ids: list[list[int]]) -> list[str]:
        return self.trainer.datamodule.tokenizer.decode(ids)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # with a subset, the loss here; the subset is decoded at the epoch's end (_decode_subset)
        self.eval_step(batch, self.decoder("valid") if self._bleu_rows is None else None)

    def on_validation_epoch_start(self) -> None:
        self.reset_eval()
        if not self.trainer.sanity_checking:  # a validation can take minutes: say when it starts, and its time at the end
            self._valid_t0 = time.monotonic()
            rank_zero_info(f"step {self.global_step} valid: started ({sum(self.trainer.num_val_batches)} batches)")
        size = self.eval_spec.valid_subset
        if size is not None and self.decoder("valid") is not None:
            self._bleu_rows = subset_rows(len(self.trainer.datamodule.references("valid")), size)

    def _decode_subset(self, rows: tuple[int, ...]) -> None:
        """The subset's hypotheses (this rank's shard): its sentences in batches of their own, since the
        whole set's batches cut to the subset would run as many decoder steps for fewer sentences; cut to
        trainer.limit_val_batches as the loss's batches are (debugging runs: a partial BLEU)."""
        trainer = self.trainer
        loader = trainer.datamodule.dataloader("valid", rows=rows)
        decode = self.decoder("valid")
        with trainer.precision_plugin.val_step_context():  # as Lightning runs validation_step
            for batch in itertools.islice(loader, num_batches(len(loader), trainer.limit_val_batches, "valid")):
                self._hyps.update(translate_batches(self.model, [trainer.strategy.batch_to_device(batch)], decode,
                                                    self._detok))

    def _gather(self) -> tuple[torch.Tensor, dict[int, str]]:
        """(loss, nll, ntokens summed over the split's batches, hypotheses by sentence) of every rank."""
        sums, hyps = dict(self._batch_sums), dict(self._hyps)
        if _dist():
            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (sums, hyps))
            sums = {k: v for p, _ in parts for k, v in p.items()}  # repeated padding batches collapse here
            hyps = {k: v for _, p in parts for k, v in p.items()}
        total = torch.zeros(3, dtype=torch.float64)
        for batch_sums in sums.values():  # in the loader's order on one process
            total += torch.tensor(batch_sums, dtype=torch.float64)
        return total, hyps

    def split_result(self, split: str) -> tuple[dict[str, float], dict]:
        """The pass's scores over every rank: (metrics: loss, nll, ppl [, bleu, chrf]; the full result:
        the metrics, the sacreBLEU signatures, the hypotheses in sentence order, `partial`)."""
        sums, hyps = self._gather()
        loss, nll, ntok = sums.tolist()
        ntok = max(ntok, 1.0)
        metrics = {"loss": loss / ntok, "nll": nll / ntok, "ppl": math.exp(min(nll / ntok, 50.0))}
        result: dict = dict(metrics)
        if hyps and not self.trainer.sanity_checking:
            refs = self.trainer.datamodule.references(split)
            if self._bleu_rows is not None:  # validation's subset: its sentences, numbered 0..N-1
                rows = self._bleu_rows
                result["subset"] = f"{len(rows)} of {len(refs)} sentences"
                refs, hyps = [refs[i] for i in rows], {k: hyps[i] for k, i in enumerate(rows) if i in hyps}
            if len(hyps) < len(refs) and self._limited(split):  # fast_dev_run / limit_*_batches: BLEU over
                idx = sorted(hyps)                               # what was decoded, marked partial
                refs, result["partial"] = [refs[i] for i in idx], f"{len(idx)} of {len(refs)} sentences"
                hyps = {k: hyps[i] for k, i in enumerate(idx)}
            s = score(ordered(hyps, len(refs)), refs)
            metrics.update(bleu=s["bleu"], chrf=s["chrf"])
            result.update(s, hypotheses=ordered(hyps, len(refs)))
        return metrics, result

    def _limited(self, split: str) -> bool:
        """Whether Lightning was asked to run only part of the split (debugging runs)."""
        t = self.trainer
        limit = t.limit_val_batches if split == "valid" else t.limit_test_batches
        return bool(t.fast_dev_run) or bool(t.overfit_batches) or isinstance(limit, int) or limit < 1.0

    def on_validation_epoch_end(self) -> None:
        if self._bleu_rows is not None and not self.trainer.sanity_checking:
            self._decode_subset(self._bleu_rows)
        metrics, result = self.split_result("valid")
        logged = {f"valid/{k}": v for k, v in metrics.items()}
        # Already reduced over ranks above; sync_dist only silences Lightning (values are equal).
        self.log_dict(logged, sync_dist=_dist(), prog_bar=True)
        line = score_line(f"step {self.global_step} valid", logged, result)  # a line per validation
        if not self.trainer.sanity_checking:
            self.last_validation = {"step": self.global_step, "metrics": dict(metrics),
                                    "result": {k: v for k, v in result.items() if k != "hypotheses"}}
            line += f"  ({time.monotonic() - self._valid_t0:.0f} s)"
        rank_zero_info(line)

    # ---- checkpoints: enough to rebuild model + tokenizer without Hydra -------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["model_config"] = self.model_cfg.to_dict()
        checkpoint["lr_schedule_total"] = getattr(self, "lr_total", None)  # resume= under another max_steps says so
        if self.spikes is not None:  # the window survives a kill: a continued run skips as a straight one
            checkpoint["spike_gate"] = self.spikes.state_dict()
        if self.tokenizer_proto is not None:
            checkpoint["tokenizer_proto"] = self.tokenizer_proto

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokenizer_proto = checkpoint.get("tokenizer_proto", self.tokenizer_proto)
        if self.spikes is not None and "spike_gate" in checkpoint:
            self.spikes.load_state_dict(checkpoint["spike_gate"])
