"""A sweep goes on past a failed job: the failure is a results.json (status failed), not a crash."""
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, tiny_overrides


def _train(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _tiny(small_corpus, tmp_path) -> list[str]:
    over = [o for o in tiny_overrides(small_corpus, tmp_path / "unused", tmp_path / "cache")
            if not o.startswith(("+run_dir", "data.train_src"))]
    return over + ["trainer.max_steps=2", "trainer.val_check_interval=2", "eval.test=false",
                   "callbacks.checkpoint.keep_last_n=0", "name=j${hydra:job.num}"]


def test_multirun_records_a_failed_job_and_runs_the_others(small_corpus, tmp_path):
    sweep = tmp_path / "sweep"
    bad = tmp_path / "no_such_file.de"
    p = _train(["-m", f"data.train_src={bad},{small_corpus['train_src']}", *_tiny(small_corpus, tmp_path),
                f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"])
    assert p.returncode == 0, p.stderr[-3000:]
    failed = json.loads((sweep / "0" / "results.json").read_text())
    assert failed["status"] == "failed"
    assert "no_such_file.de" in failed["error"]
    assert failed["choices"]["norm"] == "prenorm" and "traceback" in failed
    ok = json.loads((sweep / "1" / "results.json").read_text())
    assert ok["status"] == "completed" and ok["steps"] == 2


def test_single_run_that_fails_exits_nonzero_and_still_leaves_results(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    p = _train([f"data.train_src={tmp_path / 'missing.de'}", *_tiny(small_corpus, tmp_path),
                f"hydra.run.dir={run_dir}"])
    assert p.returncode != 0
    assert "missing.de" in p.stderr
    assert json.loads((run_dir / "results.json").read_text())["status"] == "failed"
