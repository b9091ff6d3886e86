"""SIGTERM after the last step's check (during its validation, or while its checkpoint is written)
stops the run before the final passes: `preempted` with a checkpoint of the last step, as a SIGTERM
during training is, and the rerun scores it (issue 37: the final scoring had gone on for minutes,
and a cluster sends SIGKILL seconds after SIGTERM)."""
import json
import os
import signal
import time

import pytest

import normlab.final_test as final_test
from normlab.callbacks.full_checkpoint import FullStateCheckpoint
from normlab.lit_module import Seq2SeqModule
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

pytestmark = pytest.mark.integration

STEPS = 8  # tiny_overrides: validation at steps 4 and 8, the last


def signal_in_validation(monkeypatch, sent: list) -> None:
    """SIGTERM from inside the validation of the last step (after its step-boundary check)."""
    real = Seq2SeqModule.validation_step

    def validation_step(self, batch, batch_idx):
        if self.global_step == STEPS and not self.trainer.sanity_checking and not sent:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, batch, batch_idx)

    monkeypatch.setattr(Seq2SeqModule, "validation_step", validation_step)


def signal_after_the_last_save(monkeypatch, sent: list) -> None:
    """SIGTERM once the checkpoint of the last step is written (after every other train-end hook)."""
    real = FullStateCheckpoint.on_train_end

    def on_train_end(self, trainer, pl_module):
        real(self, trainer, pl_module)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(FullStateCheckpoint, "on_train_end", on_train_end)


@pytest.mark.parametrize("send", [signal_in_validation, signal_after_the_last_save], ids=["validation", "last_save"])
def test_sigterm_after_the_last_steps_check_skips_the_final_passes(send, small_corpus, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    over = tiny_overrides(small_corpus, run_dir, tmp_path / "cache") + ["eval.test_greedy=false"]
    passes, sent = [], []
    real_score = final_test.score_split
    monkeypatch.setattr(final_test, "score_split", lambda *a, **k: passes.append(a[3]) or real_score(*a, **k))
    with monkeypatch.context() as m:
        send(m, sent)
        with pytest.raises(SystemExit) as stop:
            run(compose_cfg(over))
    took = time.monotonic() - sent[0]
    assert stop.value.code == 128 + signal.SIGTERM and passes == []  # was: every final pass, then exit 143
    first = json.loads((run_dir / "results.json").read_text())
    assert (first["status"], first["stopped_by"], first["steps"]) == ("preempted", "SIGTERM", STEPS)
    assert not [k for k in first if k.startswith(("valid_", "test_"))] and not (run_dir / "test.hyp").exists()
    assert (run_dir / "checkpoints" / f"full-step{STEPS}.ckpt").is_file()
    assert took < 30, took  # the results written, the loggers closed: no pass over a split
    again = run(compose_cfg(over))  # the same command: nothing left to train, then the final passes
    assert again["status"] == "completed" and again["steps"] == STEPS and isinstance(again["test_bleu"], float)
    assert passes == ["valid", "test"]  # (no greedy pass; fewer than 2 step checkpoints: no averaged one)
    assert [leg["from_step"] for leg in again["code_legs"]] == [0, STEPS]

