"""Ctrl-C during the final scoring: the run is `interrupted`, not `completed` without its scores
(which a rerun would skip as finished); the same command scores it and records it completed."""
import json

import pytest

import normlab.train as train_mod
from normlab.train import run

from conftest import compose_cfg, tiny_overrides


def interrupted_while_scoring(over: list[str], monkeypatch) -> None:
    """Train the run, then press Ctrl-C while the final scoring runs (it raises out of run)."""
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt  # the user presses Ctrl-C while the test set decodes

    with monkeypatch.context() as m:
        m.setattr(train_mod, "final_scores", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            run(compose_cfg(over))


def test_ctrl_c_while_scoring_is_interrupted_and_the_rerun_scores_it(small_corpus, tmp_path, monkeypatch):
    over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + [
        "trainer.max_steps=6", "trainer.val_check_interval=3", "eval.test_greedy=false", "eval.test_average=false"]

    interrupted_while_scoring(over, monkeypatch)
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert first["status"] == "interrupted" and "test_bleu" not in first and first["steps"] == 6
    again = run(compose_cfg(over))  # the same command: continues (nothing left to train), then scores
    assert again["status"] == "completed" and isinstance(again["test_bleu"], float) and again["steps"] == 6
    assert json.loads((tmp_path / "run" / "results.json").read_text())["test_bleu"] == again["test_bleu"]


def test_a_run_the_stall_guard_stopped_is_not_trained_further_by_its_rerun(small_corpus, tmp_path, monkeypatch):
    """Stopped early as stalled, then Ctrl-C while scoring: the rerun continues from the checkpoint
    written at the stop and scores it as the stalled run it is (was: it trained `window` more steps
    until the guard found the stall again, and recorded the later step)."""
    from test_stall import STALL

    over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + STALL[:3] + [
        "trainer.max_steps=60", "eval.valid_bleu=false", "eval.test_decoder.beam=2", "eval.test_decoder.max_len_b=5",
        "eval.decoder.max_len_b=5", "callbacks.stall.stop_after=8", "callbacks.stall.margin=-0.5", "optim.lr=1e-12",
        "optim.warmup=1", "callbacks.full_checkpoint.every_n_steps=7"]

    interrupted_while_scoring(over, monkeypatch)
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert first["status"] == "interrupted" and first["steps"] == 20
    again = run(compose_cfg(over))
    assert again["status"] == "stalled" and again["steps"] == 20
    assert (again["stall_detected_step"], again["stopped_at_step"]) == (12, 20)
    assert again["stall_reason"] == first["stall_reason"]
    assert again["test_loss"] > 0 and again["test_bleu"] is None  # scored as a stalled run: its loss only


def _stalling(small_corpus, run_dir, cache, *extra):
    from test_stall import STALL

    return tiny_overrides(small_corpus, run_dir, cache) + STALL[:3] + [
        "eval.valid_bleu=false", "eval.test_decoder.beam=2", "eval.test_decoder.max_len_b=5",
        "eval.decoder.max_len_b=5", "callbacks.stall.margin=-0.5", "optim.lr=1e-12", "optim.warmup=1", *extra]


def test_a_stall_decided_at_the_last_step_survives_an_interrupted_scoring(small_corpus, tmp_path, monkeypatch):
    """No early stop (stop_after null): the stall is decided when training ends, after the last
    checkpoint; Ctrl-C while scoring, then the rerun trains nothing (its checkpoint is at the last
    step, so Lightning calls no train hook) and still records the run as stalled (was: completed)."""
    over = _stalling(small_corpus, tmp_path / "run", tmp_path / "cache", "trainer.max_steps=20",
                     "callbacks.full_checkpoint.every_n_steps=10")

    interrupted_while_scoring(over, monkeypatch)
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert first["status"] == "interrupted" and first["steps"] == 20 and first["stall_reason"]
    again = run(compose_cfg(over))
    assert again["status"] == "stalled" and again["steps"] == 20 and again["stall_reason"] == first["stall_reason"]


def test_resuming_a_stalled_run_elsewhere_trains_on(small_corpus, tmp_path):
    """resume= another run's checkpoint written where its stall guard stopped it: that run's end is
    not this one's; with a working lr and a longer budget it trains on (a plateau can end)."""
    first = run(compose_cfg(_stalling(small_corpus, tmp_path / "a", tmp_path / "cache", "trainer.max_steps=60",
                                      "callbacks.stall.stop_after=8")))
    assert first["status"] == "stalled" and first["steps"] == 20
    ckpt = sorted((tmp_path / "a" / "checkpoints").glob("full-step*.ckpt"))[-1]
    over = _stalling(small_corpus, tmp_path / "b", tmp_path / "cache", "trainer.max_steps=28",
                     f"resume={ckpt}") + ["optim.lr=3e-3"]
    again = run(compose_cfg(over))
    assert again["steps"] == 28 and "stopped_at_step" not in again
