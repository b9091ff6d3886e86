"""The scores of a finished run, each under one key in results.json and in the logger.

- valid_{loss,nll,ppl,bleu,chrf}: the scored checkpoint (the best by validation BLEU, else the final
  weights) re-validated; not logged again (valid/bleu is logged once per validation during
  training; the W&B summary of valid/* is set to these values, loggers.finish_loggers). When the
  best checkpoint was saved by the last validation of this process, that validation scored the same
  weights with the same batches and decoder: its scores are taken, not computed again (a 31 s pass
  of a CPU study run), and train.log says so;
- test_{loss,nll,ppl,bleu,chrf} (logged as test/bleu, ...): eval.test_decoder (beam 4) on that checkpoint;
- test_{bleu,chrf}_greedy: the validation decoder (greedy) on the test set, when the test decoder differs;
- test_{loss,nll,ppl,bleu,chrf}_avg: the average of the last `callbacks.step_checkpoints.keep_last_n`
  checkpoints (written every `every_n_steps` steps as step<N>.ckpt), decoded like test_bleu
  (Vaswani et al. 2017 report averaged checkpoints: the last 5 for base models); an nGPT model's
  average is renormalised onto its unit sphere first (averaging.constrain_mean_, Loshchilov et al. 2025);
- partial: which passes scored only part of their split (fast_dev_run, limit_*_batches);
- decoders: the decoder settings of valid and test.
A stalled run (callbacks/stall.py) is scored by the loss of its valid and test passes only
(valid_/test_ loss, nll, ppl; their bleu and chrf None, no test.hyp), and not by the greedy and
averaged passes: a model at its input-independent floor decodes to the length cap or searches until
its beams end, for a BLEU of 0 (issue 21; deep_bleu's stalled post-LN seed 2 spent ~252 s of its
1,146 s in the beam test; 99 s of 442 s, with 33 s for the final valid pass and 32 s for the
validation at the stop, when benchmarks/stalled_arm.py reran it with 1 thread beside one study job).
Its valid_bleu is None (an Optuna trial that stalls returns 0.0: run_result.objective). Runs recorded
before this rule keep the BLEU of 0.0 they were decoded to. (Validation during training scores the
loss only while a stall is held: callbacks/stall.py.)
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from normlab.averaging import CheckpointMismatch, average_checkpoints, save_checkpoint, step_checkpoints
from normlab.checkpoint import CheckpointError, atomic_write_bytes
from normlab.lit_module import rank_zero_info, score_line
from normlab.outcome import SCORED, Status
from normlab.run_spec import FinalPasses
from normlab.scoring import load_weights, log_metrics, score_split

log = logging.getLogger("normlab")
METRICS = ("loss", "nll", "ppl", "bleu", "chrf")


def evaluation_pass(out: dict, trainer, module, dm, split: str, ckpt: str | None, suffix: str = "",
                    keys: tuple[str, ...] = METRICS, log_scores: bool = True, decode=None,
                    loss_only: bool = False) -> dict:
    """Score `ckpt` (None: the module's weights) on `split` (with `decode` instead of the split's
    decoder if given) directly, outside Lightning's loops (scoring.py); add `<split>_<metric><suffix>`
    for each key to `out` (the loggers get `<split>/<metric><suffix>`, the same values, unless
    `log_scores` is false); the pass's full result."""
    if ckpt:
        load_weights(trainer, module, ckpt)
    name = Path(ckpt).name if ckpt else "final weights"
    # progress lines name the pass ("final test greedy (...)"); the score line's keys carry the suffix
    scored = score_split(trainer, module, dm, split, decode, label=f"final {split}{suffix.replace('_', ' ')} ({name})",
                         loss_only=loss_only)
    result: dict = {}
    if scored is not None:  # None: the split's batch limit is 0, nothing was scored
        metrics, result = scored
        logged = {f"{split}/{k}{suffix}": v for k, v in metrics.items() if k in keys}
        if log_scores:
            log_metrics(trainer, logged)
        rank_zero_info(score_line(f"final {split} ({name})", logged, result))
    out.update({f"{split}_{k}{suffix}": result.get(k) for k in keys})
    if "partial" in result:
        out.setdefault("partial", {})[f"{split}{suffix}"] = result["partial"]
    return result


def merge_scores(out: dict, more: dict) -> dict:
    """out.update(more), except `partial`, which is merged: every pass that scored part of its split
    keeps its entry (a greedy or averaged pass must not erase the beam pass's)."""
    partial = {**(out.get("partial") or {}), **(more.get("partial") or {})}
    out.update(more)
    if partial:
        out["partial"] = partial
    return out


def final_scores(passes: FinalPasses, trainer, module, dm, run_dir: Path, status: Status) -> dict[str, Any]:
    """Validation and test scores of one checkpoint: the best by validation BLEU if there is one.
    `status` is what training ended as (normlab/outcome.py); a diverged or preempted run is not scored."""
    if trainer.interrupted or status not in SCORED:
        return {}  # a stopped (max_time) run is scored when the rerun completes it (outcome.SCORED)
    # (train.run calls this under scoring.signals_interrupt: SIGTERM / SIGUSR1 ends the passes, the
    # run is `interrupted`, the rerun scores it)
    ck = trainer.checkpoint_callback
    ckpt = ck.best_model_path if ck is not None and ck.best_model_path else None  # a path: "best" is ambiguous
    out: dict[str, Any] = {"checkpoint": ckpt or "final weights"}
    stalled = status is Status.STALLED  # at the floor: its BLEU is 0, its decodes minutes (above)
    last = validated_scores(trainer, module, ckpt, stalled)
    if last is not None:
        out.update({f"valid_{k}": last["result"].get(k) for k in METRICS})
        if "partial" in last["result"]:
            out.setdefault("partial", {})["valid"] = last["result"]["partial"]
        logged = {f"valid/{k}": v for k, v in last["metrics"].items()}
        rank_zero_info(score_line(f"final valid ({Path(ckpt).name})", logged, last["result"])
                       + f"  (the step {last['step']} validation's scores: the same weights, not computed again)")
    else:
        evaluation_pass(out, trainer, module, dm, "valid", ckpt, log_scores=False, loss_only=stalled)
    if not passes.test:
        return out
    t = evaluation_pass(out, trainer, module, dm, "test", ckpt, loss_only=stalled)
    out.update(bleu_signature=t.get("bleu_signature"), chrf_signature=t.get("chrf_signature"))
    if trainer.is_global_zero and "hypotheses" in t:
        text = ("\n".join(t["hypotheses"]) + "\n").encode("utf-8")  # whole or not at all (a SIGTERM here)
        atomic_write_bytes(run_dir / "test.hyp", lambda f: f.write(text))
    if stalled:  # a greedy or averaged re-decode would add nothing but time (issue 21)
        return out
    merge_scores(out, extra_test_scores(passes, trainer, module, dm, ckpt, run_dir))  # greedy, averaged
    return out


def validated_scores(trainer, module, ckpt: str | None, stalled: bool) -> dict | None:
    """The last validation's scores (Seq2SeqModule.last_validation) when the final valid pass would
    repeat it: the best checkpoint was saved by that validation in this process (BestCheckpoint.
    best_saved_at), its BLEU was over every sentence (no eval.valid_subset) and it decoded as the pass
    would (a stalled run's pass scores the loss only). Else None: the pass runs."""
    last, saved = module.last_validation, getattr(trainer.checkpoint_callback, "best_saved_at", None)
    if ckpt is None or last is None or saved != (ckpt, last["step"]) or "subset" in last["result"]:
        return None
    decodes = not stalled and module.decoder("valid") is not None
    return last if ("bleu" in last["metrics"]) == decodes else None


def extra_test_scores(passes: FinalPasses, trainer, module, dm, ckpt: str | None, run_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"decoders": passes.decoders}
    if passes.greedy:
        # teacher-forced loss / ppl are the beam pass's: only the decoded scores get a key
        evaluation_pass(out, trainer, module, dm, "test", ckpt, suffix="_greedy", keys=("bleu", "chrf"),
                        decode=module.decode)
    if passes.average_last_n > 0:
        merge_scores(out, _averaged_test(trainer, module, dm, run_dir, passes.average_last_n))
    return out


def _averaged_test(trainer, module, dm, run_dir: Path, n: int) -> dict[str, Any]:
    paths = step_checkpoints(run_dir)[-n:]
    if len(paths) < 2:
        log.info("test_bleu_avg: %d step checkpoint(s) in %s, need 2 to average", len(paths), run_dir)
        return {"test_bleu_avg": None}
    avg_path = run_dir / "checkpoints" / f"avg-last{len(paths)}.ckpt"
    if trainer.is_global_zero:
        try:
            averaged = average_checkpoints(paths)
        except (CheckpointMismatch, CheckpointError) as e:  # the run's own checkpoints: a bug or a corruption
            raise RuntimeError(f"the run's step checkpoints do not average: {e}") from e
        save_checkpoint(averaged, avg_path)
    trainer.strategy.barrier()
    out: dict[str, Any] = {"averaged_checkpoints": [p.name for p in paths], "averaged_checkpoint": str(avg_path)}
    evaluation_pass(out, trainer, module, dm, "test", str(avg_path), suffix="_avg")
    return out


def summary_lines(results: dict[str, Any]) -> list[str]:
    """What the console shows at the end of a run: the scores it has, never a None."""
    def fmt(label: str, key: str) -> str | None:
        v = results.get(key)
        return f"{label} {v:.2f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    steps = f", steps {results['steps']} of {results['planned_steps']}" if results.get("planned_steps") else ""
    lines = [f"run folder: {results.get('run_dir')}  (status: {results.get('status')}{steps})"]
    for title, parts in (("test", [fmt("BLEU", "test_bleu"), fmt("chrF", "test_chrf"),
                                   fmt("greedy BLEU", "test_bleu_greedy"), fmt("averaged BLEU", "test_bleu_avg"),
                                   fmt("loss", "test_loss")]),
                         ("valid", [fmt("BLEU", "valid_bleu"), fmt("loss", "valid_loss"), fmt("ppl", "valid_ppl")])):
        shown = [p for p in parts if p]
        if shown:
            lines.append(f"{title}: " + "  ".join(shown))
    if results.get("test_bleu") is not None and results.get("bleu_signature"):
        lines.append(f"BLEU signature: {results['bleu_signature']}")
    if results.get("partial"):
        lines.append("partial scores (debugging limits): " + ", ".join(f"{k} {v}" for k, v in results["partial"].items()))
    return lines
