"""Slow variants of tests/test_runs_survive.py (`make test-slow`; run them whenever the
continuation code changes): kill -9 at several steps and after a checkpoint on an epoch boundary, a
2-process DDP run killed and continued, SIGTERM sent from outside."""
import json
import signal
import time

import pytest
import torch

from normlab.callbacks.full_checkpoint import full_checkpoints
from normlab.train import run

from conftest import compose_cfg
from test_runs_survive import STEPS, assert_same_run, final_state, overrides, reference, train_subprocess  # noqa: F401

pytestmark = pytest.mark.integration  # every test trains or runs a command through the entry point

DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


@pytest.mark.slow
@pytest.mark.parametrize("step", [1, 4, 5, 6, 8, 11, 16, 17, 23])
def test_kill_9_at_many_steps(reference, small_corpus, step):
    root, ref = reference
    run_dir = root / f"slow-killed-at-{step}"
    args = overrides(small_corpus, run_dir, root / "cache")
    p = train_subprocess(args, at_step=step, sig=signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert run(compose_cfg(args))["status"] == "completed"
    assert_same_run(ref, run_dir, f"killed at step {step}")


@pytest.mark.slow
def test_ddp_run_killed_and_continued_equals_an_uninterrupted_one(small_corpus, tmp_path):
    ref, killed = tmp_path / "ddp-ref", tmp_path / "ddp-killed"
    p = train_subprocess(overrides(small_corpus, ref, tmp_path / "cache", *DDP))
    assert p.returncode == 0, p.stderr[-3000:]
    args = overrides(small_corpus, killed, tmp_path / "cache", *DDP)
    p = train_subprocess(args, at_step=13, sig=signal.SIGKILL)  # every rank dies at step 13
    assert p.returncode != 0
    p = train_subprocess(args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert final_state(killed)["global_step"] == STEPS
    assert_same_run(ref, killed, "DDP, killed at step 13")


@pytest.mark.slow
def test_sigterm_sent_from_outside_writes_a_checkpoint_and_stops(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = overrides(small_corpus, run_dir, tmp_path / "cache", "trainer.max_steps=100000",
                     "trainer.val_check_interval=100000", "eval.valid_bleu=false")
    proc = train_subprocess(args, wait=False)
    deadline = time.time() + 300
    while not full_checkpoints(run_dir / "checkpoints") and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "preempted" and 0 < results["steps"] < 100000
    assert full_checkpoints(run_dir / "checkpoints")[0][0] == results["steps"]


@pytest.mark.slow
def test_killed_after_a_checkpoint_at_the_epochs_last_batch(small_corpus, tmp_path):
    """The checkpoint sits on an epoch boundary: the continued run starts the next epoch with the same
    batch order and the same RNG as the uninterrupted one (the loaders' own generator)."""
    import hydra

    ref, killed = tmp_path / "ref", tmp_path / "killed"
    dm = hydra.utils.instantiate(compose_cfg(overrides(small_corpus, ref, tmp_path / "cache")).data)
    dm.setup("fit")
    epoch = len(dm.train_dataloader())  # batches per epoch
    more = [f"trainer.max_steps={epoch + 8}", f"callbacks.full_checkpoint.every_n_steps={epoch}"]
    assert run(compose_cfg(overrides(small_corpus, ref, tmp_path / "cache", *more)))["status"] == "completed"
    args = overrides(small_corpus, killed, tmp_path / "cache", *more)
    p = train_subprocess(args, at_step=epoch + 3, sig=signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert full_checkpoints(killed / "checkpoints")[0][0] == epoch
    assert run(compose_cfg(args))["status"] == "completed"
    a, b = final_state(ref), final_state(killed)
    assert a["global_step"] == b["global_step"] == epoch + 8
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
