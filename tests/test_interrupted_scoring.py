"""Ctrl-C during the final scoring: the run is `interrupted`, not `completed` without its scores
(which a rerun would skip as finished); the same command scores it and records it completed."""
import json

import pytest

import normlab.train as train_mod
from normlab.train import run

from conftest import compose_cfg, tiny_overrides


def test_ctrl_c_while_scoring_is_interrupted_and_the_rerun_scores_it(small_corpus, tmp_path, monkeypatch):
    over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + [
        "trainer.max_steps=6", "trainer.val_check_interval=3", "eval.test_greedy=false", "eval.test_average=false"]

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt  # the user presses Ctrl-C while the test set decodes

    with monkeypatch.context() as m:
        m.setattr(train_mod, "final_scores", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            run(compose_cfg(over))
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert first["status"] == "interrupted" and "test_bleu" not in first and first["steps"] == 6
    again = run(compose_cfg(over))  # the same command: continues (nothing left to train), then scores
    assert again["status"] == "completed" and isinstance(again["test_bleu"], float) and again["steps"] == 6
    assert json.loads((tmp_path / "run" / "results.json").read_text())["test_bleu"] == again["test_bleu"]
