"""run(cfg): resolve the run once (run_spec.py), then, from the RunSpec alone (no raw config below
here), find or continue its folder, build data + model + trainer, fit, score, write results.json.

`train.py` at the project root is the Hydra entry point; this module holds the work so that
tests and other commands can call it with a composed config. Where a run lives and whether it
continues: run_folder.py; what it is called and tagged: identity.py.
"""
from __future__ import annotations

import logging
import os
import platform
import time
from typing import Any

import dataclasses

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar
from normlab.budget import stopped_by_time
from normlab.callbacks.full_checkpoint import NO_CONTINUATION, FullStateCheckpoint, StopAfterCheckpoint
from normlab.callbacks.preemption import Preemption, max_time_seconds
from normlab.callbacks.plateau import PlateauStop
from normlab.callbacks.stall import StallGuard
from normlab.checkpoint import CheckpointError, load_checkpoint, write_json
from normlab.checkpoint_io import AtomicCheckpointIO
from normlab.config import ConfigError
from normlab.callbacks import RunValues, instantiate_callbacks
from normlab.final_test import final_scores, summary_lines
from normlab.hardware import cpu_info, cpu_seconds, cpu_text
from normlab.lit_module import Seq2SeqModule
from normlab.loggers import build_loggers, finish_loggers
from normlab.outcome import RunOutcome, Status
from normlab.provenance import code_legs, code_version
import normlab.resolvers  # noqa: F401  (conf/hydra's nl.run_dir / nl.run_name / nl.study)
from normlab.run_folder import (csv_histories, locked, prepare, rank_zero, readable, restore_csv_histories,
                                start_checkpoint_path)
from normlab.run_spec import RunSpec, resolve
from normlab.scoring import signals_interrupt
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


def load_finetune_weights(model, ckpt: dict, path) -> None:
    """The checkpoint's weights; LayerDrop's draw counter starts afresh with the other counters
    (and a LayerDrop rate set to 0 for fine-tuning has none)."""
    fresh = "draw_state"
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items()
             if k.startswith("model.") and not k.endswith(fresh)}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes differ: a model setting typed on the command line
        raise ConfigError(f"finetune={path}: the weights do not fit the model: {str(e).splitlines()[-1].strip()}") from None
    missing = [k for k in missing if not k.endswith(fresh)]
    if missing or unexpected:
        raise ConfigError(f"finetune={path}: the weights do not fit the model (missing: {missing[:3]}, "
                          f"unexpected: {unexpected[:3]})")


def check_weights_fit(module, ckpt: dict, path) -> None:
    """resume=: Lightning restores the checkpoint strictly; a model setting typed on the command line
    that changes a shape is one ConfigError here instead of a traceback from inside fit. Exactly what
    a strict load accepts fits: where the keys or shapes differ, the modules' load pre-hooks may
    still reconcile them, e.g. a pruned HybridNorm* stack whose rebuilt first layer has an input norm
    the saved one lacks (schemes/recent.py, _drop_unsaved_input_norm), so the strict load decides.
    It changes `module` as the hooks do before Lightning's own load, which is in time: Trainer._run
    (lightning 2.6) restores the model (_restore_modules_and_callbacks) before strategy.setup builds
    the optimizers, for every strategy whose restore_checkpoint_after_setup is False (ours: single
    device and DDP; FSDP and DeepSpeed restore after setup)."""
    theirs = ckpt["state_dict"]
    if _first_difference(module.state_dict(), theirs) is None:
        return
    try:
        module.load_state_dict(theirs, strict=True)
    except RuntimeError as e:  # missing, unexpected or mis-shaped weights that no hook reconciles
        # named after the hooks ran (they run before the load fails): a difference they leave
        first = _first_difference(module.state_dict(), theirs) or str(e).splitlines()[-1].strip()
        raise ConfigError(f"resume={path}", f"the checkpoint's weights do not fit the model the command line builds "
                          f"(first difference: {first}); drop the model overrides, or use finetune=") from None


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


def _first_difference(own: dict, theirs: dict) -> str | None:
    """The first key only one of two state dicts has, else the first whose shapes differ, or None."""
    bad = sorted(set(own) ^ set(theirs)) or [k for k in own if own[k].shape != theirs[k].shape]
    return bad[0] if bad else None


def _plugins() -> list:
    plugins: list = [AtomicCheckpointIO()]
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    if SLURMEnvironment.detect():  # requeue is ours (callbacks/preemption.py), after an exact checkpoint
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


def _cores() -> int:
    # the cores this process may run on (a container's or a SLURM job's share), not the host's count
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_text(trainer) -> str:
    """What trained the run, for results.json and the studies' cost lines: e.g. "cpu: x86_64, AMD
    EPYC, AVX2 kernels, 2 cores, 2 threads" (the kernel path decides the rounding: hardware.py) or
    "cuda: NVIDIA A100-SXM4-40GB x 4" (one per process)."""
    dev = trainer.strategy.root_device
    what = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else f"{platform.machine()}, {cpu_text()}, {_cores()} cores, {torch.get_num_threads()} thread"
                 + ("s" if torch.get_num_threads() != 1 else ""))
    return f"{dev.type}: {what}" + (f" x {trainer.world_size}" if trainer.world_size > 1 else "")


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


def run(cfg: Any) -> dict[str, Any]:
    """Train and score the run the composed config `cfg` describes (resolved here, once, into a
    RunSpec); its folder is held by this process throughout (run_folder.locked)."""
    spec = resolve(cfg)  # named, validated and merged with its start checkpoint's model, once
    with locked(spec.run_dir, rank_zero()):
        return _run(spec)


def _run(spec: RunSpec) -> dict[str, Any]:
    t0, cpu0 = time.time(), cpu_seconds()
    code = code_version() if rank_zero() else None  # this leg's code (provenance.py): rank 0 writes results
    run_dir, name = spec.run_dir, spec.name
    outcome = RunOutcome()  # what the run ends as: the guards and preemption report to it
    seconds = max_time_seconds(spec.max_time) if spec.max_time else None  # ours: at a step boundary, checkpointed
    values = RunValues(outcome=outcome, optim=spec.optim, started=t0, code=code, max_time=seconds)
    callbacks = build_callbacks(spec.callbacks, values, spec.finetune)  # a bad setting fails here, before any work
    cont = prepare(run_dir, spec.identity, spec.identity_hash, name, spec.retrain, rank_zero())
    if cont.finished is not None:
        r = cont.finished
        print(f"{run_dir}: already {r.get('status')} (test BLEU {r.get('test_bleu')}, {r.get('steps')} steps); "
              "not training again (retrain=true trains it again)")
        return r
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(spec.seed, workers=True)
    # Every check comes before the run's first log line, so that a refusal is the one line it says
    # (errors.py): the start checkpoint, then its weights against the model (before the data where
    # the checkpoint holds its tokenizer), then the corpus, and only then what the run will do.
    start = spec.start
    start_ckpt = start_checkpoint_path(str(start), resume=not spec.finetune) if start else None
    start_state = readable(start_ckpt) if start_ckpt else None
    if start_ckpt is not None and start_state is None:
        raise ConfigError(f"{start_ckpt}: not a readable checkpoint")
    done = int((start_state or {}).get("global_step") or 0)
    if spec.resume and cont.checkpoint is None and 0 < spec.max_steps <= done:
        raise ConfigError(f"resume={start}", f"the checkpoint is at step {done}: trainer.max_steps="
                                             f"{spec.max_steps} leaves nothing to train (set it above {done}, "
                                             "or use finetune= to start the step count afresh)")
    tok, module = None, None
    if start_state is not None and "tokenizer_proto" in start_state:  # the model's own vocabulary
        from normlab.data.tokenizer import Tokenizer

        tok = Tokenizer.from_proto(start_state["tokenizer_proto"])
        module = _start_module(spec, tok, cont, start_state, start_ckpt)  # no data read yet: the global RNG
        # is where it was (the data module draws from seeded generators of its own), so the weights are the same
    dm = hydra.utils.instantiate(spec.data, **({"tokenizer": tok} if tok is not None else {}))
    dm.setup("fit")
    tok = dm.tokenizer
    if module is None:
        module = _start_module(spec, tok, cont, start_state, start_ckpt)
    tok.save(run_dir / "tokenizer")
    for level, line in spec.budget_notes:  # the tokens per update, once the run is found to train
        log.log(level, line)
    if spec.finetune and cont.checkpoint is None:
        log.info("fine-tuning from the weights of %s", start_ckpt)
    full = next((c for c in callbacks if isinstance(c, FullStateCheckpoint)), None)
    if full is not None and not full.every and not spec.choices.get("debug"):  # debug runs restart anyway
        log.warning(NO_CONTINUATION)
    # resuming: the run folder's own newest checkpoint, else (a new folder) the `resume=` checkpoint
    ckpt_path = cont.checkpoint or (start_ckpt if spec.resume else None)
    histories = csv_histories(run_dir, cont.step)  # rows before the continuation's first step
    loggers = build_loggers(spec.loggers, run_dir, spec.project, name, spec.group, list(spec.tags),
                            config=spec.config | {"choices": spec.choices, "labels": spec.labels}, run_id=cont.wandb_id)
    # The bar is ours (callbacks.progress_bar, on a terminal only); without it Lightning would add its
    # own, which prints "Epoch 0/-2" bars into redirected logs.
    bar = any(isinstance(c, ProgressBar) for c in callbacks)
    overrides = dict(spec.trainer_overrides)
    stall = next((c for c in callbacks if isinstance(c, StallGuard)), None)
    preemption = next((c for c in callbacks if isinstance(c, Preemption)), None)
    if spec.max_time and preemption is not None:  # preemption has the cap (RunValues.max_time), not Lightning
        overrides["max_time"] = None
    trainer: L.Trainer = hydra.utils.instantiate(spec.trainer, logger=loggers or False, callbacks=callbacks,
                                                 plugins=_plugins(), default_root_dir=str(run_dir),
                                                 enable_progress_bar=bar, **overrides)
    restore_csv_histories(trainer.loggers, histories)
    if ckpt_path is not None:
        log.info("continuing from %s (step %s)", ckpt_path, cont.step if cont.checkpoint else done)
    results: dict[str, Any] = {"status": Status.RUNNING.value, "run_dir": str(run_dir), "choices": spec.choices,
                               "labels": spec.labels, "name": name, "group": spec.group, "seed": spec.seed, "identity_hash": cont.record["identity_hash"],
                               "params": module.model.num_parameters(), "planned_steps": trainer.max_steps if trainer.max_steps > 0 else None}  # -1: no step limit
    stop: Signalled | None = None
    try:
        try:
            trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt_path) if ckpt_path else None)
        except StopAfterCheckpoint:  # preempted: the checkpoint is written, the outcome says so
            pass
        if preemption is not None:  # a signal recorded after the last step's check ends the run preempted
            preemption.after_fit(trainer)
        # One scope from here to results.json: a SIGTERM / SIGUSR1 stops the run at once, `interrupted`
        # (between fit and the final passes it used to meet the default handler: a kill, no record)
        with signals_interrupt(trainer):
            if outcome.running and stall is not None and trainer.global_step >= trainer.max_steps > 0:
                stall.settle(trainer, module)  # a continuation at its last step trained nothing (callbacks/stall.py)
            if outcome.running and stopped_by_time(trainer):  # Lightning's own time limit (not ours)
                outcome.end(Status.STOPPED, stopped_by="max_time")
            elif outcome.running:  # no callback ended it: trained every planned step
                outcome.end(Status.COMPLETED)
            if outcome.status is Status.STOPPED:
                by = (f"trainer.max_time={spec.max_time}" if outcome.reasons.get("stopped_by") == "max_time"
                      else f"callbacks.preemption.stop_at_step={trainer.global_step}")
                print(f"stopped by {by} at step {trainer.global_step} of {trainer.max_steps}; rerun the same command "
                      "to continue")
            results.update(outcome.reasons)
            if stall is not None and stall.floor is not None:  # L* on every run: a screen reads its rungs against it
                results.setdefault("input_independent_loss", stall.floor)
            plateau = next((c for c in callbacks if isinstance(c, PlateauStop)), None)
            if plateau is not None and plateau.summary(trainer) is not None:  # where the curve ended (issue 35)
                results["plateau"] = plateau.summary(trainer)
            results.update(final_scores(spec.final, trainer, module, dm, run_dir, outcome.status))
            # The status last: Ctrl-C, SIGTERM or SIGUSR1 while scoring leaves `interrupted` (the rerun
            # scores it), never a `completed` run without its scores, which a rerun would skip as finished.
            results["status"] = outcome.status.value
            if spec.choices.get("debug") and outcome.status is Status.COMPLETED:
                results["status"] = Status.DEBUG.value  # never a finished run: the same command runs it again (conf/debug)
    except Signalled as signalled:  # SIGTERM / SIGUSR1 after fit stopped the run (scoring.signals_interrupt):
        stop = signalled            # handed over below, once results.json says `interrupted`
    except Exception as err:  # failure.record_failure adds the traceback; W&B gets the same status now
        results.update(status=Status.FAILED.value, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        if results["status"] == Status.RUNNING:  # Ctrl-C, a signal while scoring, an exception: not a result
            results["status"] = Status.INTERRUPTED.value
        # params again: restoring a checkpoint can change the model (a pruned HybridNorm* stack's
        # first layer loses its input norm: schemes/recent.py)
        results.update(steps=trainer.global_step, params=module.model.num_parameters(), device=device_text(trainer),
                       cpu=cpu_info(),  # the host's CPU and kernel path (hardware.py), on a GPU run too
                       code=code,  # this leg's; code_legs: every leg's commit, from which step
                       code_legs=_code_legs(code, full, cont, start_state if spec.resume else None),
                       train_tokens_per_s=round(module.stats.tokens_per_s, 1),
                       wall_s=round(full.wall_s() if full is not None else time.time() - t0, 1),
                       # rank 0's process, over all legs (null: a leg from before it was counted)
                       cpu_s=_rounded(full.cpu_s() if full is not None else cpu_seconds() - cpu0))
        if module.compile_seconds is not None:  # model.compile=true: first step, compilation included
            results["compile_s"] = round(module.compile_seconds, 1)
        if trainer.is_global_zero:
            write_json(run_dir / "results.json", results)
        finish_loggers(loggers, results)
    if trainer.is_global_zero:
        for line in summary_lines(results):
            log.info(line)
    if stop is not None:  # the handler from before (submitit's), else on SLURM a requeue for SIGUSR1; exit
        hand_over(stop.signum, stop.before, preemption is not None and preemption.requeue)  # no callback: no requeue
    for c in callbacks:
        if isinstance(c, Preemption):
            c.after_run()  # on a signal: hand over to the previous handler / requeue, then exit
    return results

