"""W&B = results.json in every end state (issue 18): a run that completes, diverges, stalls or is
preempted leaves an offline W&B run whose summary holds every results.json value under its one key,
whose state is finished (exit 0; failed runs: tests/test_multirun_failures.py), and whose history
logs each step once. (Killed then continued: tests/test_runs_survive.py.)"""
import json
import os
import signal

import pytest

from normlab.lit_module import Seq2SeqModule
from normlab.loggers import wandb_summary
from normlab.train import run

from conftest import compose_cfg, tiny_overrides
from test_runs_survive import wandb_history

pytestmark = pytest.mark.integration  # every test trains or runs a command through the entry point

STALL = ["callbacks.stall.window=4", "callbacks.stall.patience=8", "callbacks.stall.after_step=0",
         "callbacks.stall.stop_after=4", "callbacks.stall.margin=-0.5", "optim.lr=1e-12", "optim.warmup=1"]


def _explode_from_step_6(monkeypatch):
    original = Seq2SeqModule.training_step

    def step(self, batch, batch_idx):  # finite, but 10x the loss from step 6 on
        loss = original(self, batch, batch_idx)
        return loss * 10 if self.global_step >= 6 else loss

    monkeypatch.setattr(Seq2SeqModule, "training_step", step)


def _sigterm_at_step_3(monkeypatch):
    original = Seq2SeqModule.training_step

    def step(self, batch, batch_idx):
        if self.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler records it; the step ends, then a checkpoint
        return original(self, batch, batch_idx)

    monkeypatch.setattr(Seq2SeqModule, "training_step", step)


CASES = {
    "completed": ([], None),
    "diverged": (["callbacks.divergence.patience=3", "callbacks.divergence.after_step=2"], _explode_from_step_6),
    "stalled": (STALL, None),
    "preempted": (["callbacks.full_checkpoint.every_n_steps=100"], _sigterm_at_step_3),
}


@pytest.mark.parametrize("status", list(CASES))
def test_wandb_summary_is_results_json_in_every_end_state(status, small_corpus, tmp_path, monkeypatch):
    extra, patch = CASES[status]
    monkeypatch.setenv("WANDB_MODE", "offline")
    if patch is not None:
        patch(monkeypatch)
    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache")
                      + ["logger=[wandb,csv]", "trainer.max_steps=20", "trainer.val_check_interval=10",
                         "eval.test_greedy=false", "eval.test_average=false"] + extra)
    if status == "preempted":
        with pytest.raises(SystemExit) as exit_:
            run(cfg)
        assert exit_.value.code == 128 + signal.SIGTERM
    else:
        run(cfg)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == status
    rows, summary, exits = wandb_history(tmp_path / "run")
    assert exits == [0]  # W&B's state: finished, as results.json's status is a result or a pause
    for key, value in wandb_summary(results).items():
        assert summary.get(key) == value, key
    if status != "completed":  # the reasons travel with the status
        reason = {"diverged": "divergence_reason", "stalled": "stall_reason", "preempted": "stopped_by"}[status]
        assert summary[reason] == results[reason] and results[reason]
    steps = [r["_step"] for r in rows if "train/loss" in r]
    assert steps and len(steps) == len(set(steps))  # each step logged once


def _summary_with_removals(run_dir) -> dict:
    """The W&B summary the legs leave once synced in order: updates and removals applied."""
    from conftest import wandb_records

    summary = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for rec in wandb_records(path):
            if rec.WhichOneof("record_type") == "summary":
                summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
                for i in rec.summary.remove:
                    summary.pop(i.key or "/".join(i.nested_key), None)
    return summary


def test_a_continued_runs_summary_drops_the_earlier_legs_reasons(small_corpus, tmp_path, monkeypatch):
    """Preempted, then continued to the end by the same command: results.json has no stopped_by any
    more, and neither has the one W&B run (its summary outlives the first leg)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + [
        "logger=[wandb,csv]", "trainer.max_steps=8", "trainer.val_check_interval=4", "eval.test_greedy=false",
        "eval.test_average=false", "callbacks.full_checkpoint.every_n_steps=100"]
    with monkeypatch.context() as m:
        _sigterm_at_step_3(m)
        with pytest.raises(SystemExit):
            run(compose_cfg(over))
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert first["status"] == "preempted" and first["stopped_by"] == "SIGTERM"
    results = run(compose_cfg(over))
    assert results["status"] == "completed" and "stopped_by" not in results
    summary = _summary_with_removals(tmp_path / "run")
    assert len(list((tmp_path / "run").glob("wandb/offline-run-*"))) == 2
    assert "stopped_by" not in summary and summary["status"] == "completed"
    for key, value in wandb_summary(results).items():
        assert summary.get(key) == value, key
