"""A run survives any kill: rerunning the same command continues it exactly (bitwise-equal final
weights on CPU), a signal writes a checkpoint and requeues, a finished run is not trained again,
`resume=` / `finetune=` take the model from the checkpoint, a wall-clock cap says it stopped.

The killed legs run as subprocesses of train.py (a real SIGKILL / SIGUSR1 / SIGTERM); the reruns
and the uninterrupted reference run in this process with the same thread count (1), so the
floating-point reductions are the same and the weights must be equal bit for bit."""
import csv
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from normlab.callbacks.full_checkpoint import full_checkpoints
from normlab.checkpoint import load_checkpoint
from normlab.hardware import cpu_seconds
from normlab.train import run

from conftest import ROOT, compose_cfg, tiny_overrides

pytestmark = pytest.mark.integration  # every test trains or runs a command through the entry point

STEPS = 24
# dropout, LayerDrop and DropHead draw random numbers every step; validation at 8, 16, 24 picks the
# best checkpoint; full-state checkpoints every 5 steps, so kills land before, on and after them
EXTRA = ["regularizer=layerdrop_drophead", "model.dropout=0.1", f"trainer.max_steps={STEPS}",
         "trainer.val_check_interval=8", "callbacks.full_checkpoint.every_n_steps=5", "eval.test=false",
         "eval.decoder.max_len_b=5", "callbacks.step_checkpoints.every_n_steps=4", "callbacks.step_checkpoints.keep_last_n=3",
         "trainer.log_every_n_steps=2"]  # a stop off this schedule must not add a row to the history
# train.py with training_step patched to send its own process a signal at a given step, or the
# final passes' score_split as the pass of a given split starts (a file, not `python -c`:
# Lightning's DDP launcher starts the other ranks with the same command line)
RUNNER = """
import os, runpy
sig = int(os.environ["SEND_SIGNAL"])
if "AT_STEP" in os.environ:
    from normlab.lit_module import Seq2SeqModule
    step = int(os.environ["AT_STEP"])
    orig = Seq2SeqModule.training_step
    def training_step(self, batch, batch_idx):
        if self.global_step == step:
            os.kill(os.getpid(), sig)
        return orig(self, batch, batch_idx)
    Seq2SeqModule.training_step = training_step
else:
    import normlab.final_test as final_test
    split, score_split = os.environ["AT_PASS"], final_test.score_split
    def signalled(trainer, module, dm, s, *args, **kwargs):
        if s == split:
            os.kill(os.getpid(), sig)
        return score_split(trainer, module, dm, s, *args, **kwargs)
    final_test.score_split = signalled
runpy.run_path(os.environ["TRAIN_PY"], run_name="__main__")
"""


def overrides(corpus, run_dir, cache, *more):
    return tiny_overrides(corpus, run_dir, cache) + EXTRA + list(more)


def train_subprocess(args, env=None, at_step=None, sig=None, wait=True, at_pass=None):
    """train.py in a subprocess; with `sig`, it signals itself at training step `at_step`, or as the
    final pass of split `at_pass` (valid, test) starts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_PY": str(ROOT / "train.py"), **(env or {})}
    cmd = [sys.executable, str(ROOT / "train.py"), *args]
    if at_step is not None or at_pass is not None:
        runner = Path(tempfile.mkdtemp()) / "signal_at.py"
        runner.write_text(RUNNER)
        env.update({"SEND_SIGNAL": str(int(sig)), **({"AT_STEP": str(at_step)} if at_step is not None else
                                                     {"AT_PASS": at_pass})})
        cmd = [sys.executable, str(runner), *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def final_state(run_dir) -> dict:
    return torch.load(full_checkpoints(run_dir / "checkpoints")[0][1], map_location="cpu", weights_only=True)


def assert_same_run(a_dir, b_dir, note):
    a, b = final_state(a_dir), final_state(b_dir)
    assert a["global_step"] == b["global_step"] == STEPS, note
    differ = [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])]
    assert not differ, f"{note}: weights differ in {differ[:3]}"

    def history(d):  # one continuous curve: every step once, the same values (timings aside)
        return [{k: v for k, v in r.items() if k != "train/tokens_per_s"}
                for r in csv.DictReader(open(d / "csv" / "metrics.csv"))]
    assert history(a_dir) == history(b_dir), note
    ra, rb = (json.loads((d / "results.json").read_text()) for d in (a_dir, b_dir))
    assert (ra["valid_loss"], ra["valid_bleu"], ra["steps"]) == (rb["valid_loss"], rb["valid_bleu"], rb["steps"]), note
    assert [p.name for p in sorted((b_dir / "checkpoints").glob("step*.ckpt"))] == \
           [p.name for p in sorted((a_dir / "checkpoints").glob("step*.ckpt"))], note  # the averaging set
    assert not list((b_dir / "checkpoints").glob("*-v1.ckpt")), note


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("survive")
    ref = root / "reference"
    results = run(compose_cfg(overrides(small_corpus, ref, root / "cache")))
    assert results["status"] == "completed" and results["steps"] == STEPS
    return root, ref


def test_kill_9_then_rerun_continues_exactly(reference, small_corpus, capsys):
    root, ref = reference
    step = random.Random().randrange(1, STEPS)  # a random step; shown in every failure message
    run_dir = root / f"killed-at-{step}"
    args = overrides(small_corpus, run_dir, root / "cache")
    p = train_subprocess(args, at_step=step, sig=signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL, f"step {step}: {p.stderr[-2000:]}"
    assert not (run_dir / "results.json").exists()
    saved = full_checkpoints(run_dir / "checkpoints")
    assert all(s <= step for s, _ in saved), f"step {step}: {saved}"
    if len(saved) > 1:  # break the newest: the rerun must fall back to the one before it
        data = saved[0][1].read_bytes()
        saved[0][1].write_bytes(data[: len(data) // 3])
    # the CPU seconds of the killed leg, as the checkpoint the rerun continues from holds them
    start = saved[1][1] if len(saved) > 1 else saved[0][1] if saved else None
    cpu_before = load_checkpoint(start)["normlab"]["cpu_s"] if start else 0.0
    cpu0 = cpu_seconds()
    results = run(compose_cfg(args))  # the same command again
    this_leg = cpu_seconds() - cpu0
    assert results["status"] == "completed"
    assert_same_run(ref, run_dir, f"killed at step {step}, checkpoints {[s for s, _ in saved]}")
    assert results["wall_s"] > 0 and results["train_tokens_per_s"] > 0
    # issue 36: a continued run's CPU time is both legs' (the rerun's own is at most this process's)
    assert (start is None or cpu_before > 0) and cpu_before < results["cpu_s"] <= cpu_before + this_leg + 0.1
    # rerunning a finished run does not train it again
    capsys.readouterr()
    again = run(compose_cfg(args))
    assert again["steps"] == STEPS and "already completed" in capsys.readouterr().out


def test_sigusr1_checkpoints_requeues_on_slurm_and_the_requeued_job_continues(reference, small_corpus, tmp_path):
    root, ref = reference
    run_dir = root / "preempted"
    args = overrides(small_corpus, run_dir, root / "cache")
    bin_dir = tmp_path / "bin"  # a stand-in for SLURM's scontrol that records its arguments
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.args'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    p = train_subprocess(args, env=env, at_step=10, sig=signal.SIGUSR1)
    assert p.returncode == 128 + signal.SIGUSR1, p.stderr[-2000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "preempted" and results["steps"] == 11  # the step in flight finished
    assert full_checkpoints(run_dir / "checkpoints")[0][0] == 11
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    results = run(compose_cfg(args))  # what the requeued job does: the same command
    assert results["status"] == "completed"
    assert_same_run(ref, run_dir, "SIGUSR1 at step 10")


def test_sigterm_writes_a_checkpoint_and_stops(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = overrides(small_corpus, run_dir, tmp_path / "cache", "eval.valid_bleu=false")
    p = train_subprocess(args, at_step=2, sig=signal.SIGTERM)  # Lightning's own SIGTERM handler is replaced
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "preempted" and results["steps"] == 3
    assert full_checkpoints(run_dir / "checkpoints")[0][0] == 3


def test_an_unreadable_newer_checkpoint_never_displaces_a_readable_one(small_corpus, tmp_path):
    """Preempted at step 18 (full-step18 off the every-5 schedule), that file then cut short: the
    rerun continues from full-step15 and must drop the unreadable 18 (the abandoned leg's), else the
    pruning after its save at 20 keeps [20, 18] and deletes 15; with 20 broken too, nothing readable
    would be left and the run would start again from step 0."""
    run_dir = tmp_path / "run"
    args = overrides(small_corpus, run_dir, tmp_path / "cache", "eval.valid_bleu=false")
    p = train_subprocess(args, at_step=17, sig=signal.SIGTERM)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
    ck = run_dir / "checkpoints"
    assert [s for s, _ in full_checkpoints(ck)] == [18, 15]
    (ck / "full-step18.ckpt").write_bytes((ck / "full-step18.ckpt").read_bytes()[:1000])
    p = train_subprocess(args, at_step=22, sig=signal.SIGKILL)  # continues from 15, saves 20, killed
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert [s for s, _ in full_checkpoints(ck)] == [20, 15]
    (ck / "full-step20.ckpt").write_bytes(b"cut")
    p = train_subprocess(args)
    assert p.returncode == 0 and "full-step15.ckpt (step 15)" in p.stdout + p.stderr, p.stderr[-2000:]
    assert json.loads((run_dir / "results.json").read_text())["steps"] == STEPS


def test_resume_takes_the_model_from_the_checkpoint(reference, small_corpus, tmp_path, caplog):
    root, ref = reference
    # no model overrides: the defaults (d_model 128, 3+3 layers) would not fit the checkpoint
    plain = [o for o in tiny_overrides(small_corpus, tmp_path / "run", root / "cache") if not o.startswith("model.")]
    with caplog.at_level("INFO", logger="normlab"):
        results = run(compose_cfg(plain + EXTRA + [f"resume={ref}", f"trainer.max_steps={STEPS + 4}"]))
    assert results["status"] == "completed" and results["steps"] == STEPS + 4
    assert any(m.startswith("continuing from ") and m.endswith(f"(step {STEPS})") for m in caplog.messages)  # not "?"
    assert results["params"] == json.loads((ref / "results.json").read_text())["params"]
    model = json.loads((tmp_path / "run" / "run.json").read_text())["identity"]["model"]
    assert (model["d_model"], model["encoder_layers"], model["decoder_layers"]) == (32, 2, 2)
    assert results["labels"]["regularizer"] == "layerdrop0.2+drophead0.2_v"


def test_finetune_a_pruned_layerdrop_model_with_a_fresh_optimizer(reference, small_corpus, tmp_path):
    from normlab.checkpoint import load_model, save_model
    from normlab.regularizers.pruning import prune

    root, ref = reference
    model, tok = load_model(full_checkpoints(ref / "checkpoints")[0][1])
    pruned = save_model(tmp_path / "pruned.ckpt", prune(model, [1], [0]), tok.proto)
    plain = [o for o in tiny_overrides(small_corpus, tmp_path / "run", root / "cache") if not o.startswith("model.")]
    results = run(compose_cfg(plain + ["eval.test=false", "trainer.max_steps=3", f"finetune={pruned}",
                                       "trainer.log_every_n_steps=1"]))
    assert results["status"] == "completed" and results["steps"] == 3  # counters from 0
    model = json.loads((tmp_path / "run" / "run.json").read_text())["identity"]["model"]
    assert (model["d_model"], model["encoder_layers"], model["decoder_layers"]) == (32, 1, 1)
    def lr_at_step_1(d):
        return next(r["train/lr"] for r in csv.DictReader(open(d / "csv" / "metrics.csv")) if r["step"] == "1" and r.get("train/lr"))
    assert lr_at_step_1(tmp_path / "run") == lr_at_step_1(ref)  # the warmup from its start


def test_a_wall_clock_cap_says_it_stopped_the_run(small_corpus, tmp_path, capsys):
    args = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + [
        "trainer.max_steps=100000", "trainer.max_time=00:00:00:02", "trainer.val_check_interval=100000",
        "eval.test=false", "eval.valid_bleu=false"]
    results = run(compose_cfg(args))
    assert results["status"] == "stopped" and results["stopped_by"] == "max_time"
    assert 0 < results["steps"] < results["planned_steps"] == 100000
    assert "valid_loss" not in results  # not scored: the rerun continues it and scores it at its end
    assert "stopped by trainer.max_time" in capsys.readouterr().out


def test_a_max_time_stop_is_a_pause_the_rerun_continues_exactly(reference, small_corpus, tmp_path, monkeypatch):
    """trainer.max_time stops at a step boundary with a full checkpoint and no validation off the
    schedule (Lightning's Timer stopped via should_stop, which validates), so the rerun ends bitwise
    equal to the uninterrupted run. The clock is faked: one second per micro-batch, 13 allowed. The
    two legs run on two (faked) commits: results.json `code_legs` names each leg's, from its step."""
    import normlab.train as train
    from normlab.callbacks import preemption

    root, ref = reference
    ticks = iter(range(10**6))
    monkeypatch.setattr(preemption, "clock", lambda: float(next(ticks)))
    leg = lambda commit, dirty: {"commit": commit, "dirty": dirty, "torch": "t", "python": "p"}  # noqa: E731
    monkeypatch.setattr(train, "code_version", lambda: leg("a" * 40, False))
    args = overrides(small_corpus, tmp_path / "run", root / "cache", "trainer.max_time={seconds: 13}")
    first = run(compose_cfg(args))
    assert (first["status"], first["stopped_by"], first["steps"]) == ("stopped", "max_time", 13)
    assert first["code_legs"] == [{"from_step": 0, "commit": "a" * 40, "dirty": False}]
    assert [s for s, _ in full_checkpoints(tmp_path / "run" / "checkpoints")][0] == 13
    monkeypatch.undo()
    monkeypatch.setattr(train, "code_version", lambda: leg("b" * 40, True))
    results = run(compose_cfg(args))
    assert results["status"] == "completed"
    assert results["code"] == leg("b" * 40, True)  # the last leg's
    assert results["code_legs"] == [{"from_step": 0, "commit": "a" * 40, "dirty": False},
                                    {"from_step": 13, "commit": "b" * 40, "dirty": True}]
    assert_same_run(ref, tmp_path / "run", "stopped by max_time at step 13")


def wandb_history(run_dir) -> tuple[list[dict], dict, list[int]]:
    """Every leg's offline W&B history rows, the summary (last leg wins) and the legs' exit codes."""
    from conftest import wandb_records

    rows, summary, exits = [], {}, []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            items = {"history": lambda: rec.history.item, "summary": lambda: rec.summary.update}.get(kind)
            if kind == "exit":
                exits.append(rec.exit.exit_code)
            elif items:
                got = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items()}
                rows.append(got) if kind == "history" else summary.update(got)
    return rows, summary, exits


def crash_at(monkeypatch, step):
    from normlab.lit_module import Seq2SeqModule

    orig = Seq2SeqModule.training_step

    def boom(self, batch, batch_idx):
        if self.global_step == step:
            raise RuntimeError(f"boom at step {step}")
        return orig(self, batch, batch_idx)

    monkeypatch.setattr(Seq2SeqModule, "training_step", boom)


def test_a_crashed_then_continued_run_logs_each_step_once_to_wandb(small_corpus, tmp_path, monkeypatch):
    """A crash at step 14 leaves W&B's history through step 13 and the full checkpoint of step 10:
    the continuation replays 11-13, and the W&B run (both legs' files) must hold each step once,
    with the final summary = results.json. (A kill -9 lands before wandb flushes on this scale;
    then the replay fills what the file lacks, also once.)"""
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = overrides(small_corpus, tmp_path / "run", tmp_path / "cache", "logger=[wandb,csv]",
                     "trainer.log_every_n_steps=1")
    with monkeypatch.context() as m:
        crash_at(m, 14)
        with pytest.raises(RuntimeError, match="boom"):
            run(compose_cfg(args))
    first, _, _ = wandb_history(tmp_path / "run")
    # through step 13, or 12 when the crash lands before W&B's writer has the last row (seen twice
    # in CI-like runs under load); past the checkpoint's 10 either way, so the legs overlap and the
    # each-step-once check below means something
    assert 11 <= max(r["trainer/global_step"] for r in first if "train/loss" in r) <= 13
    assert max(s for s, _ in full_checkpoints(tmp_path / "run" / "checkpoints")) == 10
    results = run(compose_cfg(args))  # the same command again: continues from step 10
    rows, summary, exits = wandb_history(tmp_path / "run")
    steps = [r["trainer/global_step"] for r in rows if "train/loss" in r]
    csv_steps = [int(r["step"]) for r in csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv"))
                 if r.get("train/loss")]
    assert len(steps) == len(set(steps)) and sorted(steps) == csv_steps and len(steps) >= STEPS - 1, steps
    valid = [r["trainer/global_step"] for r in rows if "valid/loss" in r]
    assert valid == sorted(set(valid)) and len(valid) == STEPS // 8  # 8, 16, 24: once each
    assert summary["status"] == results["status"] == "completed" and summary["steps"] == STEPS
    assert exits == [1, 0]  # the crashed leg is failed in W&B, the continuation finished


def test_a_crashed_run_is_failed_in_wandb_as_in_results(small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    crash_at(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="boom"):
        run(compose_cfg(overrides(small_corpus, tmp_path / "run", tmp_path / "cache", "logger=[wandb,csv]")))
    _, summary, exits = wandb_history(tmp_path / "run")
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert summary["status"] == results["status"] == "failed"
    assert summary["error"] == results["error"] == "RuntimeError: boom at step 3"
    assert exits == [1]  # W&B's own run state: failed, not finished


def test_rungs_of_a_screen_pause_and_continue_exactly(reference, small_corpus, tmp_path, capsys):
    """Successive halving's rungs (issue 36): stop_at_step pauses at a validation step with a full
    checkpoint (status stopped, not scored), the same command with the same step trains nothing, a later
    step continues, and the run trained rung by rung ends bitwise the uninterrupted one. The folder is
    the uninterrupted run's: stop_at_step is not part of the identity."""
    root, ref = reference
    args = overrides(small_corpus, tmp_path / "run", root / "cache")
    first = run(compose_cfg(args + ["callbacks.preemption.stop_at_step=8"]))
    assert (first["status"], first["stopped_by"], first["steps"]) == ("stopped", "stop_at_step", 8)
    assert "valid_loss" not in first and "stopped by callbacks.preemption.stop_at_step=8 at step 8" in capsys.readouterr().out
    # the floor L* of the targets trained on, on a paused run too: a screen reads its rung against it
    assert 3.0 < first["input_independent_loss"] < 10.0
    assert [s for s, _ in full_checkpoints(tmp_path / "run" / "checkpoints")][0] == 8
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")) if r.get("valid/loss")]
    assert [r["step"] for r in rows] == ["7"]  # the rung's validation, what the screen ranks by
    again = run(compose_cfg(args + ["callbacks.preemption.stop_at_step=8"]))  # the same rung: nothing to train
    assert (again["status"], again["steps"]) == ("stopped", 8)
    assert run(compose_cfg(args + ["callbacks.preemption.stop_at_step=16"]))["steps"] == 16
    results = run(compose_cfg(args))
    assert results["status"] == "completed" and results["identity_hash"] == first["identity_hash"]
    assert results["input_independent_loss"] != first["input_independent_loss"]  # counted over more targets
    assert_same_run(ref, tmp_path / "run", "paused at 8 and 16")
    assert run(compose_cfg(args + ["callbacks.preemption.stop_at_step=24"]))["status"] == "completed"  # at the end: done


def test_a_bad_stop_at_step_is_one_line(small_corpus, tmp_path):
    from normlab.config import ConfigError

    for i, bad in enumerate(("0", "-3", "true", "'8'")):
        with pytest.raises(ConfigError, match=r"callbacks\.preemption\.stop_at_step=.* must be a positive number"):
            run(compose_cfg(tiny_overrides(small_corpus, tmp_path / str(i), tmp_path / "cache")
                            + [f"callbacks.preemption.stop_at_step={bad}"]))
