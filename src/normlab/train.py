"""run(cfg): resolve the run once (run_spec.py), then, from the RunSpec alone (no raw config below
here), find or continue its folder, build data + model + trainer, fit, score, write results.json.

`train.py` at the project root is the Hydra entry point; this module holds the work so that
tests and other commands can call it with a composed config. Where a run lives and whether it
continues: run_folder.py; what it is called and tagged: identity.py; its resume= / finetune= start
checkpoint, checked: start_checkpoint.py.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from normlab.budget import stopped_by_time
from normlab.callbacks.full_checkpoint import NO_CONTINUATION, FullStateCheckpoint, StopAfterCheckpoint
from normlab.callbacks.preemption import Preemption, max_time_seconds
from normlab.callbacks.observatory import Observatory
from normlab.callbacks.plateau import PlateauStop
from normlab.callbacks.stall import StallGuard
from normlab.checkpoint import CheckpointError, load_checkpoint, write_json
from normlab.checkpoint_io import AtomicCheckpointIO
from normlab.callbacks import RunValues, instantiate_callbacks
from normlab.final_test import final_scores, summary_lines
from normlab.hardware import cpu_info, cpu_seconds, device_text
from normlab.lit_module import Seq2SeqModule
from normlab.lr_schedule import schedule_change_note
from normlab.model.attention import shape_free_sdpa
from normlab.loggers import build_loggers, finish_loggers
from normlab.outcome import RunOutcome, Status
from normlab.provenance import code_legs, code_version
import normlab.resolvers  # noqa: F401  (conf/hydra's nl.run_dir / nl.run_name / nl.study)
from normlab.run_result import RunResult
from normlab.run_folder import Continuation, csv_histories, locked, prepare, rank_zero, restore_csv_histories
from normlab.run_identity import Runtime
from normlab.run_spec import RunSpec, resolve
from normlab.scoring import signals_interrupt
from normlab.start_checkpoint import Start, check_weights_fit, load_finetune_weights, start_point
from normlab.signals import Signalled, hand_over

log = logging.getLogger("normlab")


def build_callbacks(nodes: Any, values: RunValues | None = None, finetune: bool = False) -> list:
    """Every `_target_` node of `nodes` (the config's `callbacks`: normlab.callbacks), each given the
    run's `values` it takes (the run's outcome to the ones that can end a run, ...); when
    fine-tuning, not Admin's initialisation: the weights, ω included, come from the checkpoint."""
    callbacks = instantiate_callbacks(nodes, values)
    if finetune:
        from normlab.callbacks.admin_init import AdminInit

        callbacks = [c for c in callbacks if not isinstance(c, AdminInit)]
    return callbacks


def _start_module(spec: RunSpec, tok, cont, start_state: dict | None, start_ckpt) -> Seq2SeqModule:
    """The module for the tokenizer's vocabulary, with the start checkpoint's weights (finetune=) or
    checked against them (resume=: Lightning loads them in fit); a folder's own checkpoint: as it is."""
    model_cfg = dataclasses.replace(spec.model, vocab_size=tok.vocab_size, pad_id=tok.pad_id, bos_id=tok.bos_id,
                                    eos_id=tok.eos_id)  # the vocabulary the data is encoded with
    module = Seq2SeqModule(model_cfg.to_dict(), optim=spec.optim, eval=spec.eval, tokenizer_proto=tok.proto,
                           compile=spec.compile)
    if spec.finetune and cont.checkpoint is None:  # weights only; optimizer, schedule, step start afresh
        load_finetune_weights(module.model, start_state, start_ckpt)
    elif spec.resume and cont.checkpoint is None:
        check_weights_fit(module, start_state, start_ckpt)
    return module


def _plugins() -> list:
    plugins: list = [AtomicCheckpointIO()]
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    if SLURMEnvironment.detect():  # requeue is ours (callbacks/preemption.py), after an exact checkpoint
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def _code_legs(code: dict | None, full: FullStateCheckpoint | None, cont, start_state: dict | None) -> list | None:
    """results.json `code_legs` (provenance.code_legs): the full checkpoints carry them; without that
    callback, or before it loaded one, from the checkpoint the run continues from (its folder's, or
    `resume=`'s), if any."""
    if code is None:  # not rank 0: it writes no results
        return None
    # The callback knows the legs once it has loaded the checkpoint it continues from; a fit that
    # failed before that (or a run without the callback) takes them from the checkpoint itself.
    if full is not None and (full.restored or (cont.checkpoint is None and start_state is None)):
        return full.code_legs()
    if cont.checkpoint is not None:  # the folder's own, not loaded: its legs read here (mmap: no tensors)
        try:  # (this runs as the run ends, after any failure: it must not raise a second one)
            state = load_checkpoint(cont.checkpoint, mmap=True)
        except (CheckpointError, OSError):  # unreadable: its earlier legs stay unknown
            state = {}
        return code_legs(_legs_in(state), code, cont.step)
    state = start_state or {}  # resume=: the legs that trained its weights; finetune= starts afresh
    return code_legs(_legs_in(state), code, int(state.get("global_step") or 0))


def _legs_in(checkpoint: dict) -> list | None:
    """The code legs a checkpoint names, if they are the callback's (a list of {from_step, commit,
    dirty} of plain values); None (unknown) for anything else, which results.json could not hold."""
    ours = checkpoint.get("normlab")
    legs = ours.get("code_legs") if isinstance(ours, dict) else None
    plain = (str, int, bool, type(None))
    ok = isinstance(legs, list) and all(isinstance(leg, dict) and all(isinstance(v, plain) for v in leg.values())
                                        for leg in legs)
    return legs if ok else None


def run(cfg: Any, runtime: Runtime | None = None) -> RunResult:
    """Train and score the run the composed config `cfg` describes, as `runtime` launches it (None:
    outside Hydra), resolved here, once, into a RunSpec. What it ended as, also written to results.json
    and the W&B summary: a RunResult (run_result.py)."""
    return run_resolved(resolve(cfg, runtime))  # named, validated and merged with its start checkpoint's model


def run_resolved(spec: RunSpec) -> RunResult:
    """Train and score a resolved run; its folder is held by this process throughout (run_folder.locked)."""
    with locked(spec.run_dir, rank_zero()):
        return _run(spec)


@dataclass
class _Leg:
    """This invocation of the run (a leg: a rerun continues it), built from the RunSpec; the steps
    below read its fields."""
    spec: RunSpec
    cont: Continuation
    start: Start
    callbacks: list
    outcome: RunOutcome
    code: dict | None  # this leg's code (provenance.py), on rank 0: it writes the results
    t0: float
    cpu0: float
    dm: Any = None
    module: Seq2SeqModule | None = None
    trainer: L.Trainer | None = None
    loggers: list = dataclasses.field(default_factory=list)

    def find(self, cls: type):
        return next((c for c in self.callbacks if isinstance(c, cls)), None)


def _run(spec: RunSpec) -> RunResult:
    t0, cpu0 = time.time(), cpu_seconds()
    code = code_version() if rank_zero() else None  # this leg's code (provenance.py): rank 0 writes results
    outcome = RunOutcome()  # what the run ends as: the guards and preemption report to it
    seconds = max_time_seconds(spec.max_time) if spec.max_time else None  # ours: at a step boundary, checkpointed
    values = RunValues(outcome=outcome, optim=spec.optim, started=t0, code=code, max_time=seconds)
    callbacks = build_callbacks(spec.callbacks, values, spec.finetune)  # a bad setting fails here, before any work
    cont = prepare(spec.run_dir, spec.identity, spec.identity_hash, spec.name, spec.retrain, rank_zero())
    if cont.finished is not None:
        done = RunResult.from_record(cont.finished)
        print(f"{spec.run_dir}: already {done.status} (test BLEU {done.get('test_bleu')}, {done.get('steps')} steps); "
              "not training again (retrain=true trains it again)")
        return done
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(spec.seed, workers=True)
    leg = _Leg(spec, cont, start_point(spec, cont), callbacks, outcome, code, t0, cpu0)
    _data_and_module(leg)
    _announce(leg)
    ckpt_path = _build_trainer(leg)
    result, stop = _train_and_score(leg, ckpt_path)
    if leg.trainer.is_global_zero:
        for line in summary_lines(result):
            log.info(line)
    preemption = leg.find(Preemption)
    if stop is not None:  # the handler from before (submitit's), else on SLURM a requeue for SIGUSR1; exit
        before = preemption.handler_before(stop.signum) if preemption is not None else stop.before
        hand_over(stop.signum, before, preemption is not None and preemption.requeue)  # no callback: no requeue
    if preemption is not None:
        preemption.after_run()  # on a signal: hand over to the previous handler / requeue, then exit
    return result


def _data_and_module(leg: _Leg) -> None:
    """The data module, set up, and the LightningModule for its vocabulary (the start checkpoint's own
    where it holds one); the tokenizer is saved into the run folder."""
    spec, start, tok = leg.spec, leg.start, None
    if start.state is not None and "tokenizer_proto" in start.state:  # the model's own vocabulary
        from normlab.data.tokenizer import Tokenizer

        tok = Tokenizer.from_proto(start.state["tokenizer_proto"])
        leg.module = _start_module(spec, tok, leg.cont, start.state, start.ckpt)  # no data read yet: the global
        # RNG is where it was (the data module draws from seeded generators of its own), so the weights are the same
    leg.dm = hydra.utils.instantiate(spec.data, **({"tokenizer": tok} if tok is not None else {}))
    leg.dm.setup("fit")
    if leg.module is None:
        leg.module = _start_module(spec, leg.dm.tokenizer, leg.cont, start.state, start.ckpt)
    leg.dm.tokenizer.save(spec.run_dir / "tokenizer")


def _announce(leg: _Leg) -> None:
    """What the run will do, once it is found to train: the tokens per update, fine-tuning, and a
    run that could not continue after a kill."""
    for level, line in leg.spec.budget_notes:
        log.log(level, line)
    if leg.spec.finetune and leg.cont.checkpoint is None:
        log.info("fine-tuning from the weights of %s", leg.start.ckpt)
    if leg.spec.resume and leg.cont.checkpoint is None and leg.start.state.get("lr_schedulers"):
        o, state = leg.spec.optim, leg.start.state
        saved = (state.get("hyper_parameters") or {}).get("optim") or {}
        total = leg.spec.max_steps if leg.spec.max_steps > 0 else None
        note = schedule_change_note((saved.get("schedule"), saved.get("warmup"), state.get("lr_schedule_total")),
                                    (o.schedule, o.warmup, total), state["lr_schedulers"][0])
        if note:
            log.warning("resume=%s: %s", leg.spec.start, note)
    full = leg.find(FullStateCheckpoint)
    if full is not None and not full.every and not leg.spec.choices.get("debug"):  # debug runs restart anyway
        log.warning(NO_CONTINUATION)


def _build_trainer(leg: _Leg) -> Path | None:
    """The loggers and the Trainer (the CSV history restored to the continuation's first step); the
    checkpoint fit continues from: the run folder's own newest, else (a new folder) resume='s."""
    spec, cont = leg.spec, leg.cont
    ckpt_path = cont.checkpoint or (leg.start.ckpt if spec.resume else None)
    histories = csv_histories(spec.run_dir, cont.step)  # rows before the continuation's first step
    leg.loggers = build_loggers(spec.loggers, spec.run_dir, spec.project, spec.name, spec.group, list(spec.tags),
                                config=spec.config | {"choices": spec.choices, "labels": spec.labels},
                                run_id=cont.wandb_id)
    # The bar is ours (callbacks.progress_bar, on a terminal only); without it Lightning would add its
    # own, which prints "Epoch 0/-2" bars into redirected logs.
    bar = any(isinstance(c, ProgressBar) for c in leg.callbacks)
    overrides = dict(spec.trainer_overrides)
    if spec.max_time and leg.find(Preemption) is not None:  # preemption has the cap (RunValues.max_time)
        overrides["max_time"] = None
    leg.trainer = hydra.utils.instantiate(spec.trainer, logger=leg.loggers or False, callbacks=leg.callbacks,
                                          plugins=_plugins(), default_root_dir=str(spec.run_dir),
                                          enable_progress_bar=bar, **overrides)
    restore_csv_histories(leg.trainer.loggers, histories)
    shape_free_sdpa(leg.trainer.strategy.root_device)  # no per-shape cuDNN attention plans (model/attention.py)
    if ckpt_path is not None:
        log.info("continuing from %s (step %s)", ckpt_path, cont.step if cont.checkpoint else leg.start.step)
    return ckpt_path


def _train_and_score(leg: _Leg, ckpt_path: Path | None) -> tuple[RunResult, Signalled | None]:
    """Fit, end the outcome, score; the RunResult written (results.json, the W&B summary) whatever
    happens, and an exception raised again once it is. Its reasons and scores are what was recorded
    when it stopped; the status last: Ctrl-C, SIGTERM or SIGUSR1 while scoring leaves `interrupted`
    (the rerun scores it), never a `completed` run without its scores, which a rerun would skip."""
    trainer, outcome = leg.trainer, leg.outcome
    status, reasons, scores, stop = Status.RUNNING, {}, {}, None
    try:
        try:
            trainer.fit(leg.module, datamodule=leg.dm, ckpt_path=str(ckpt_path) if ckpt_path else None)
        except StopAfterCheckpoint:  # preempted: the checkpoint is written, the outcome says so
            pass
        preemption = leg.find(Preemption)
        if preemption is not None:  # a signal recorded after the last step's check ends the run preempted
            preemption.after_fit(trainer)
        # One scope from here to results.json: a SIGTERM / SIGUSR1 stops the run at once, `interrupted`
        # (between fit and the final passes it used to meet the default handler: a kill, no record)
        with signals_interrupt(trainer):
            _end_outcome(leg)
            reasons = _reasons(leg)
            scores = _plateau(leg)
            scores = {**scores, **final_scores(leg.spec.final, trainer, leg.module, leg.dm, leg.spec.run_dir,
                                               outcome.status)}
            debug = leg.spec.choices.get("debug") and outcome.status is Status.COMPLETED
            status = Status.DEBUG if debug else outcome.status  # a debug run is never finished: the same command runs it again
    except Signalled as signalled:  # SIGTERM / SIGUSR1 after fit stopped the run (scoring.signals_interrupt):
        stop = signalled            # handed over by _run, once results.json says `interrupted`
    except Exception as err:  # failure.record_failure adds the traceback; W&B gets the same status now
        status, reasons = Status.FAILED, {**reasons, "error": f"{type(err).__name__}: {err}"}
        raise
    finally:
        if status is Status.RUNNING:  # Ctrl-C, a signal while scoring, an exception: not a result
            status = Status.INTERRUPTED
        preemption = leg.find(Preemption)
        try:  # a SIGTERM / SIGUSR1 from fit's end to here is preemption's to record (callbacks/preemption.py)
            # built inside: should counting raise (a device lost), the handlers from before still come back
            result = RunResult(status, reasons, scores, _counters(leg), _provenance(leg))
            if trainer.is_global_zero:
                write_json(leg.spec.run_dir / "results.json", result.record)
            finish_loggers(leg.loggers, result)
        finally:
            if preemption is not None:  # the record is written: the handlers from before the run are back
                preemption.release()
    return result, stop


def _end_outcome(leg: _Leg) -> None:
    """What training ended as when no callback ended it: stopped by Lightning's own time limit, or
    completed (every planned step trained); a stop says how to continue."""
    trainer, outcome, stall = leg.trainer, leg.outcome, leg.find(StallGuard)
    if outcome.running and stall is not None and trainer.global_step >= trainer.max_steps > 0:
        stall.settle(trainer, leg.module)  # a continuation at its last step trained nothing (callbacks/stall.py)
    if outcome.running and stopped_by_time(trainer):  # Lightning's own time limit (not ours)
        outcome.end(Status.STOPPED, stopped_by="max_time")
    elif outcome.running:  # no callback ended it: trained every planned step
        outcome.end(Status.COMPLETED)
    if outcome.status is Status.STOPPED:
        by = (f"trainer.max_time={leg.spec.max_time}" if outcome.reasons.get("stopped_by") == "max_time"
              else f"callbacks.preemption.stop_at_step={trainer.global_step}")
        print(f"stopped by {by} at step {trainer.global_step} of {trainer.max_steps}; rerun the same command "
              "to continue")


def _reasons(leg: _Leg) -> dict[str, Any]:
    """Why the run ended as it did (the callbacks' reasons), and L* on every run: a screen reads its
    rungs against it."""
    stall = leg.find(StallGuard)
    floor = {} if stall is None or stall.floor is None else {"input_independent_loss": stall.floor}
    return {**floor, **leg.outcome.reasons}  # a stall's own L* first


def _plateau(leg: _Leg) -> dict[str, Any]:
    """Where the validation curve ended (issue 35), when the plateau callback watched it, and the stability
    observatory's last statistics, when it was on."""
    plateau, observatory = leg.find(PlateauStop), leg.find(Observatory)
    summary = plateau.summary(leg.trainer) if plateau is not None else None
    observed = observatory.summary() if observatory is not None else None  # the last validation's statistics
    out = {} if summary is None else {"plateau": summary}
    return out if observed is None else {**out, "observatory": observed}


def _counters(leg: _Leg) -> dict[str, Any]:
    """Steps, parameters, throughput and time, as the run ends (any way it ends)."""
    trainer, module, full = leg.trainer, leg.module, leg.find(FullStateCheckpoint)
    counters = {"planned_steps": trainer.max_steps if trainer.max_steps > 0 else None,  # -1: no step limit
                "steps": trainer.global_step,
                # after fit: restoring a checkpoint can change the model (a pruned HybridNorm* stack's
                # first layer loses its input norm: schemes/recent.py)
                "params": module.model.num_parameters(),
                "train_tokens_per_s": round(module.stats.tokens_per_s, 1),
                "wall_s": round(full.wall_s() if full is not None else time.time() - leg.t0, 1),
                # rank 0's process, over all legs (null: a leg from before it was counted)
                "cpu_s": _rounded(full.cpu_s() if full is not None else cpu_seconds() - leg.cpu0)}
    if module.compile_seconds is not None:  # model.compile=true: first step, compilation included
        counters["compile_s"] = round(module.compile_seconds, 1)
    if module.spikes is not None:  # optim.skip_spikes: how many updates were skipped, and at which steps
        counters.update(module.spikes.record())
    return counters


def _provenance(leg: _Leg) -> dict[str, Any]:
    """What ran (the RunSpec's names), on what (device_text, hardware.cpu_info: the host's CPU and
    kernel path, on a GPU run too) and with which code (this leg's; code_legs: every leg's commit,
    from which step)."""
    spec, full = leg.spec, leg.find(FullStateCheckpoint)
    return {"run_dir": str(spec.run_dir), "choices": spec.choices, "labels": spec.labels, "name": spec.name,
            "group": spec.group, "seed": spec.seed, "identity_hash": leg.cont.record["identity_hash"],
            "device": device_text(leg.trainer), "cpu": cpu_info(), "code": leg.code,
            "code_legs": _code_legs(leg.code, full, leg.cont, leg.start.state if spec.resume else None)}
