"""SIGTERM in the two windows where no handler of the run's used to hold (issue 37, review): after
Lightning's teardown has put back the handlers from before fit, and while the final results.json is
written. The signal is recorded as during training: the run ends `preempted` (after the teardown:
no final passes) or as it was (the record was complete), results.json is written whole, and only then
does the handler from before the run (submitit's, which resubmits the job) get the signal; the same
command continues the run. Was: that handler, or the default action (a kill), came first, with no
results.json on disk."""
import json
import os
import signal

import pytest

import normlab.train as train_mod
from normlab.callbacks.full_checkpoint import FullStateCheckpoint
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

pytestmark = pytest.mark.integration

STEPS = 8  # tiny_overrides


def earlier_handler(run_dir, calls: list):
    """The handler installed before the run: it notes what results.json said when the signal came."""
    def handler(signum, frame):
        path = run_dir / "results.json"
        calls.append((signum, json.loads(path.read_text())["status"] if path.exists() else None))
    return handler


def fit_with_sigterm_after_teardown(monkeypatch, sent: list) -> None:
    """SIGTERM from a callback's teardown hook: Lightning calls it after its own teardown, which has
    put back the handlers it found when fit started."""
    def teardown(self, trainer, pl_module, stage):
        if stage == "fit" and not sent:
            sent.append(signal.getsignal(signal.SIGTERM))
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(FullStateCheckpoint, "teardown", teardown, raising=False)


def test_sigterm_after_lightnings_teardown_ends_the_run_preempted(small_corpus, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    over = tiny_overrides(small_corpus, run_dir, tmp_path / "cache") + ["eval.test_greedy=false"]
    calls, sent = [], []
    earlier = earlier_handler(run_dir, calls)
    original = signal.signal(signal.SIGTERM, earlier)
    try:
        with monkeypatch.context() as m:
            fit_with_sigterm_after_teardown(m, sent)
            with pytest.raises(SystemExit) as stop:
                run(compose_cfg(over))
        assert sent[0] is not earlier  # the run's own handler held after the teardown
        assert signal.getsignal(signal.SIGTERM) is earlier  # and the one from before is back
    finally:
        signal.signal(signal.SIGTERM, original)
    assert stop.value.code == 128 + signal.SIGTERM
    assert calls == [(signal.SIGTERM, "preempted")]  # handed over once, after the record was written
    first = json.loads((run_dir / "results.json").read_text())
    assert (first["status"], first["stopped_by"], first["steps"]) == ("preempted", "SIGTERM", STEPS)
    assert not [k for k in first if k.startswith("test_")]  # no final passes after the signal
    again = run(compose_cfg(over))  # the same command: nothing left to train, then the final passes
    assert again["status"] == "completed" and again["steps"] == STEPS and isinstance(again["test_bleu"], float)


def test_sigterm_while_results_json_is_written_is_handed_over_after_it(small_corpus, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    over = tiny_overrides(small_corpus, run_dir, tmp_path / "cache") + [
        "eval.test_greedy=false", "eval.test_average=false"]
    calls, writes = [], []
    real = train_mod.write_json

    def write_json(path, data):
        writes.append(data["status"])
        os.kill(os.getpid(), signal.SIGTERM)  # as the final record is being written
        real(path, data)

    original = signal.signal(signal.SIGTERM, earlier_handler(run_dir, calls))
    try:
        with monkeypatch.context() as m:
            m.setattr(train_mod, "write_json", write_json)
            with pytest.raises(SystemExit) as stop:
                run(compose_cfg(over))
    finally:
        signal.signal(signal.SIGTERM, original)
    assert stop.value.code == 128 + signal.SIGTERM and writes == ["completed"]
    assert calls == [(signal.SIGTERM, "completed")]  # the record was whole when the job was let go
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and isinstance(results["test_bleu"], float)
    assert not list(run_dir.glob("*.tmp*")) and not list(run_dir.glob(".results.json*"))
    again = run(compose_cfg(over))  # the same command finds it finished
    assert again == results


def test_without_a_signal_the_handlers_from_before_are_back(small_corpus, tmp_path):
    """The run's handler is the process's only while the run is: a caller that goes on (a sweep, a
    study's tests) finds its own handler in place."""
    def mine(signum, frame):
        pass

    original = signal.signal(signal.SIGUSR1, mine)
    try:
        over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + [
            "trainer.max_steps=2", "trainer.val_check_interval=2", "eval.test=false"]
        assert run(compose_cfg(over))["status"] == "completed"
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, original)
