"""A tiny end-to-end run: train a few steps, checkpoint, reload without Hydra, score again."""
import json
import time
from pathlib import Path

import pytest
import torch

from normlab.checkpoint import load_model, resolve_checkpoint
from normlab.evaluation import make_decoder, ordered, score, translate_batches
from normlab.train import run

from conftest import compose_cfg, tiny_overrides


@pytest.fixture(scope="module")
def finished_run(small_corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose_cfg(tiny_overrides(small_corpus, run_dir, run_dir.parent / "cache"))
    t0 = time.time()
    results = run(cfg)
    return run_dir, results | {"measured_wall_s": time.time() - t0}, cfg


def test_results_json(finished_run):
    run_dir, results, _ = finished_run
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["status"] == "completed"
    assert saved["steps"] == 8
    for key in ("test_bleu", "valid_bleu", "valid_loss", "params", "train_tokens_per_s", "wall_s", "cpu_s"):
        assert isinstance(saved[key], (int, float)), key
    assert saved["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    import os, platform, re

    from normlab.study.readme import machine_share

    # what trained it, in the words the studies' cost reads back: the share of the machine it used
    m = re.fullmatch(r"cpu: (\S+), (.+), (\S+) kernels(?: \([^)]*\))?, (\d+) cores, (\d+) (thread|threads)",
                     saved["device"])  # (...): MKL / oneDNN overrides set in the environment (hardware.py)
    assert m, saved["device"]
    n, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))  # the cores it may use
    model = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)[1].strip()
    capability = torch.backends.cpu.get_cpu_capability()  # the kernels ran: the rounding it has
    assert (m[1], m[2], m[3], int(m[4]), int(m[5]), m[6]) \
        == (platform.machine(), model, capability, cores, n, "thread" if n == 1 else "threads")
    assert saved["cpu"]["model"] == model and saved["cpu"]["capability"] == capability
    assert saved["cpu"]["mkl"].startswith(torch.__config__.show().split("Library Version ")[1][:6])
    assert machine_share(saved) == min(1.0, n / cores)
    assert saved["params"] == results["params"] > 0
    # which code trained it: this checkout's commit, whether src/ or conf/ differ from it, torch
    import subprocess

    from normlab.provenance import ROOT

    git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    if (ROOT / ".git").exists():
        assert saved["code"]["commit"] == git("rev-parse", "HEAD") and len(saved["code"]["commit"]) == 40
        assert saved["code"]["dirty"] == bool(git("status", "--porcelain", "--untracked-files=normal", "--", "src", "conf"))
    else:  # not a git checkout (an unpacked archive): no commit to name
        assert saved["code"]["commit"] is None and saved["code"]["dirty"] is None
    assert saved["code"]["torch"] == torch.__version__ and saved["code"]["python"] == platform.python_version()
    assert saved["code_legs"] == [{"from_step": 0, "commit": saved["code"]["commit"], "dirty": saved["code"]["dirty"]}]
    # the final test loads the best checkpoint: its counters must not replace the run's (wall_s was
    # once the best checkpoint's wall time plus the whole run's)
    assert 0 < saved["wall_s"] <= results["measured_wall_s"] + 0.1
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "tokenizer" / "spm.model").is_file()
    assert len((run_dir / "test.hyp").read_text().splitlines()) == 40


def test_checkpoint_reloads_without_hydra_and_scores_the_same(finished_run, small_corpus):
    run_dir, results, cfg = finished_run
    model, tok = load_model(resolve_checkpoint(run_dir))
    assert not model.training
    from normlab.data.datamodule import TranslationDataModule

    dm = TranslationDataModule(**{k: v for k, v in cfg.data.items() if k != "_target_"})
    dm.setup("test")
    hyps = translate_batches(model, dm.dataloader("test"), make_decoder(**cfg.eval.test_decoder), tok.decode)
    refs = dm.references("test")
    assert score(ordered(hyps, len(refs)), refs)["bleu"] == results["test_bleu"]


def test_loss_decreases(finished_run):
    import csv

    run_dir = finished_run[0]
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0]


@pytest.mark.integration
def test_no_bar_in_a_redirected_log(small_corpus, tmp_path, capfd):
    # stdout is not a terminal under pytest: our bar declines, and Lightning must not add its own
    # (it printed "Epoch 0/-2 ━━━" bars into train.log and SLURM logs)
    over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache")
    cfg = compose_cfg([o for o in over if "enable_progress_bar" not in o] + [
        "trainer.enable_progress_bar=true", "trainer.max_steps=2", "eval.test=false"])
    assert cfg.trainer.enable_progress_bar is True
    assert run(cfg)["status"] == "completed"
    out, err = capfd.readouterr()
    assert "━" not in out + err and "Epoch 0" not in out + err


def test_summary_line_names_the_planned_steps_only_when_there_is_a_step_limit():
    from normlab.final_test import summary_lines

    base = {"run_dir": "r", "status": "completed", "steps": 517}
    assert "steps 517 of 2000" in summary_lines({**base, "planned_steps": 2000})[0]
    assert "of" not in summary_lines({**base, "planned_steps": None})[0]  # an epoch-based run: no "of -1"
