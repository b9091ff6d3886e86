"""A sweep goes on past a failed job: the failure is a results.json (status failed), not a crash.
With W&B on, each job is its own finished W&B run, grouped by sweep folder and tagged with its choices."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, tiny_overrides, wandb_records

pytestmark = pytest.mark.integration  # every test trains or runs a command through the entry point


def _train(args: list[str], cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _tiny(small_corpus, tmp_path) -> list[str]:
    over = [o for o in tiny_overrides(small_corpus, tmp_path / "unused", tmp_path / "cache")
            if not o.startswith(("++run_dir", "data.train_src"))]
    return over + ["trainer.max_steps=2", "trainer.val_check_interval=2", "eval.test=false",
                   "callbacks.step_checkpoints.keep_last_n=0", "name=j${hydra:job.num}"]


def test_multirun_records_a_failed_job_and_runs_the_others(small_corpus, tmp_path):
    sweep = tmp_path / "sweep-x1"
    bad = tmp_path / "no_such_file.de"
    p = _train(["-m", f"data.train_src={bad},{small_corpus['train_src']}", "norm=postnorm,prenorm",
                *_tiny(small_corpus, tmp_path), "logger=wandb", "logger.wandb.mode=offline",
                f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"])
    assert p.returncode == 0, p.stderr[-3000:]
    results = {int(d.name): json.loads((d / "results.json").read_text()) for d in sweep.iterdir() if d.is_dir()}
    assert sorted(results) == [0, 1, 2, 3]
    failed = [r for r in results.values() if r["status"] == "failed"]
    ok = [r for r in results.values() if r["status"] == "completed"]
    assert len(failed) == 2 and len(ok) == 2
    assert all("no_such_file.de" in r["error"] and "traceback" in r for r in failed)
    assert {r["choices"]["norm"] for r in failed} == {r["choices"]["norm"] for r in ok} == {"postnorm", "prenorm"}
    assert all(r["steps"] == 2 for r in ok)
    # W&B: one offline run per completed job, each finished (an exit record), grouped by the sweep folder
    runs = sorted(sweep.glob("*/wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 2
    seen = {}
    for f in runs:
        recs = list(wandb_records(f))
        run = next(r.run for r in recs if r.WhichOneof("record_type") == "run")
        assert any(r.WhichOneof("record_type") == "exit" and r.exit.exit_code == 0 for r in recs), f
        assert run.run_group == "sweep-x1"
        seen[run.run_id] = set(run.tags)
    assert len(seen) == 2
    norms = [t for tags in seen.values() for t in tags if t.startswith("norm:")]
    assert sorted(norms) == ["norm:post_ln", "norm:pre_ln"]  # resolved values, not the choice names
    assert all({"init:xavier", "enc:2", "seed:1"} <= tags for tags in seen.values())


def test_single_run_with_a_bad_corpus_is_one_line_and_leaves_no_folder(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    p = _train([f"data.train_src={tmp_path / 'missing.de'}", *_tiny(small_corpus, tmp_path),
                f"hydra.run.dir={run_dir}"])
    assert p.returncode == 2
    assert p.stderr.splitlines()[-1] == f"error: {tmp_path / 'missing.de'}: corpus file not found", p.stderr
    assert "Traceback" not in p.stderr + p.stdout and not run_dir.exists()


def test_single_run_that_crashes_exits_nonzero_and_still_leaves_results(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    p = _train([f"data.train_src={small_corpus['train_src']}", *_tiny(small_corpus, tmp_path),
                "+callbacks.crash._target_=conftest.CrashAtStep", "+callbacks.crash.step=1",
                f"hydra.run.dir={run_dir}"], env={"PYTHONPATH": str(ROOT / "tests")})
    assert p.returncode == 1
    assert "Traceback" in p.stderr and "crash at step 1" in p.stderr  # a bug keeps its traceback
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "failed" and "crash at step 1" in results["error"]


@pytest.mark.slow
def test_optuna_sweep_runs_trials_and_writes_the_best(small_corpus, tmp_path):
    sweep = tmp_path / "optuna"
    p = _train(["-m", "+sweep=optuna_lr", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=1",
                f"hydra.sweeper.storage=sqlite:///{tmp_path / 'optuna.db'}",  # the README's resumable storage
                f"data.train_src={small_corpus['train_src']}", *_tiny(small_corpus, tmp_path), "eval.valid_bleu=true",
                f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"])
    assert p.returncode == 0, p.stderr[-3000:]
    best = (sweep / "optimization_results.yaml").read_text()
    assert "best_params" in best and "optim.lr" in best and "best_value" in best
    assert len([d for d in sweep.iterdir() if (d / "results.json").is_file()]) == 2
    import optuna

    assert len(optuna.load_study(study_name="lr_warmup_dropout", storage=f"sqlite:///{tmp_path / 'optuna.db'}").trials) == 2
