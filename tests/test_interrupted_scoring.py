"""Ctrl-C, SIGTERM or SIGUSR1 during the final scoring: the run is `interrupted`, not `completed`
without its scores (which a rerun would skip as finished); the same command scores it and records it
completed. A signal is handed over after results.json is written: to the handler installed before,
else (SIGUSR1 on SLURM) as a requeue; the process exits 128 + signal."""
import json
import os
import signal
from pathlib import Path

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


@pytest.mark.integration
def test_ctrl_c_while_scoring_is_interrupted_and_the_rerun_scores_it(small_corpus, tmp_path, monkeypatch):
    over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + [
        "trainer.max_steps=6", "trainer.val_check_interval=3", "eval.test_greedy=false", "eval.test_average=false"]

    interrupted_while_scoring(over, monkeypatch)
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert first["status"] == "interrupted" and "test_bleu" not in first and first["steps"] == 6
    again = run(compose_cfg(over))  # the same command: continues (nothing left to train), then scores
    assert again["status"] == "completed" and isinstance(again["test_bleu"], float) and again["steps"] == 6
    # two legs: the one that trained from 0, the one that only scored from 6 (Lightning skips
    # on_train_start there: the leg's start must still be its checkpoint's step)
    assert [leg["from_step"] for leg in first["code_legs"]] == [0]
    assert [leg["from_step"] for leg in again["code_legs"]] == [0, 6]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["test_bleu"] == again["test_bleu"]


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
def test_resuming_a_stalled_run_elsewhere_trains_on(small_corpus, tmp_path, monkeypatch):
    """resume= another run's checkpoint written where its stall guard stopped it: that run's end is
    not this one's; with a working lr and a longer budget it trains on (a plateau can end), also in
    its own later legs (Ctrl-C while scoring, then the same command), whose checkpoints must not
    carry the other run's stall on (was: the continued leg ended `stalled` with run a's reason)."""
    first = run(compose_cfg(_stalling(small_corpus, tmp_path / "a", tmp_path / "cache", "trainer.max_steps=60",
                                      "callbacks.stall.stop_after=8")))
    assert first["status"] == "stalled" and first["steps"] == 20
    ckpt = sorted((tmp_path / "a" / "checkpoints").glob("full-step*.ckpt"))[-1]

    def resumed(folder: str) -> list[str]:
        return _stalling(small_corpus, tmp_path / folder, tmp_path / "cache", "trainer.max_steps=28",
                         f"resume={ckpt}") + ["optim.lr=3e-3"]

    again = run(compose_cfg(resumed("b")))
    assert again["steps"] == 28 and "stopped_at_step" not in again
    assert [leg["from_step"] for leg in again["code_legs"]] == [0, 20]  # run a's leg, then its own
    interrupted_while_scoring(resumed("c"), monkeypatch)
    continued = run(compose_cfg(resumed("c")))
    assert continued["steps"] == 28 and continued["status"] == again["status"]
    assert continued.get("stall_reason") == again.get("stall_reason")


# Every final pass (valid, beam test, greedy test, averaged test), each short.
SCORED = ["trainer.max_steps=6", "trainer.val_check_interval=3", "eval.decoder.max_len_b=5",
          "eval.test_decoder.max_len_b=5", "callbacks.step_checkpoints.every_n_steps=2",
          "callbacks.step_checkpoints.keep_last_n=2"]


def scontrol_stub(tmp_path) -> tuple[dict[str, str], Path]:
    """SLURM's environment with a stand-in scontrol first on PATH that records its arguments."""
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol.args"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {record}\n")
    (bin_dir / "scontrol").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0"}, record


def scores(results: dict) -> dict:
    return {k: v for k, v in results.items() if k.startswith(("valid_", "test_"))}


@pytest.mark.integration
@pytest.mark.slow  # make test: a signal while scoring (the Ctrl-C test above) and SIGUSR1's requeue on SLURM (test_runs_survive.py)
def test_sigusr1_while_scoring_requeues_on_slurm_and_the_rerun_scores_it(small_corpus, tmp_path):
    """SLURM's time-limit warning (SIGUSR1) while a real run decodes its test set: the run is recorded
    `interrupted` without scores, the job requeued, the process exits 138 (was: killed by the signal,
    no results.json, no requeue); the requeued command scores it as an uninterrupted run is scored."""
    from test_runs_survive import train_subprocess

    ref = run(compose_cfg(tiny_overrides(small_corpus, tmp_path / "ref", tmp_path / "cache") + SCORED))
    assert ref["status"] == "completed" and ref["test_bleu_avg"] is not None and "test_bleu_greedy" in ref
    args = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + SCORED
    env, record = scontrol_stub(tmp_path)
    p = train_subprocess(args, env=env, at_pass="test", sig=signal.SIGUSR1)
    assert p.returncode == 128 + signal.SIGUSR1 == 138, p.stderr[-2000:]
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert first["status"] == "interrupted" and first["steps"] == 6 and not scores(first)
    assert "checkpoint" not in first and not (tmp_path / "run" / "test.hyp").exists()
    assert record.read_text().split() == ["requeue", "4242"]
    again = run(compose_cfg(args))  # what the requeued job does: the same command
    assert again["status"] == "completed" and again["steps"] == 6
    assert scores(again) == scores(ref) and len(scores(ref)) == 17
    assert (tmp_path / "run" / "test.hyp").read_bytes() == (tmp_path / "ref" / "test.hyp").read_bytes()
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == again


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_while_scoring_goes_to_the_handler_installed_before(sig, small_corpus, tmp_path, monkeypatch):
    """A handler installed before the run (submitit's) gets the signal that stops a final pass, after
    results.json says `interrupted` (a requeue must find it written; was: SIGTERM's handler was
    called before it was written, SIGUSR1 never stopped the pass), and no scontrol runs besides it;
    the process exits 128 + signal and the earlier handler is back in place."""
    import normlab.final_test as final_test

    env, record = scontrol_stub(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = []

    def earlier(signum, frame):
        path = tmp_path / "run" / "results.json"
        calls.append((signum, json.loads(path.read_text())["status"] if path.exists() else None))

    real = final_test.score_split

    def signalled(trainer, module, dm, split, *args, **kwargs):
        if split == "test":
            assert signal.getsignal(sig) is not earlier  # the final passes' own handler
            os.kill(os.getpid(), sig)
        return real(trainer, module, dm, split, *args, **kwargs)

    monkeypatch.setattr(final_test, "score_split", signalled)
    original = signal.signal(sig, earlier)
    try:
        with pytest.raises(SystemExit) as stop:
            run(compose_cfg(tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + SCORED))
        assert signal.getsignal(sig) is earlier
    finally:
        signal.signal(sig, original)
    assert stop.value.code == 128 + sig and calls == [(sig, "interrupted")]
    assert not record.exists()  # the earlier handler requeues, if anyone does
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "interrupted" and not scores(results) and results["steps"] == 6


def test_signals_interrupt_stops_once_and_restores_the_handlers():
    """The context manager alone: the first signal raises Signalled with the handler from before and
    passes the signal to the launched processes; a second one while it unwinds is ignored."""
    from types import SimpleNamespace

    from normlab.scoring import signals_interrupt
    from normlab.signals import Signalled

    killed = []
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(kill=killed.append)))
    earlier = [lambda s, f: None, lambda s, f: None]
    saved = [signal.signal(s, h) for s, h in zip((signal.SIGTERM, signal.SIGUSR1), earlier)]
    try:
        with pytest.raises(Signalled) as stop:
            with signals_interrupt(trainer):
                try:
                    os.kill(os.getpid(), signal.SIGUSR1)
                finally:
                    os.kill(os.getpid(), signal.SIGTERM)  # while unwinding: ignored
        assert (stop.value.signum, stop.value.before, stop.value.code) == (signal.SIGUSR1, earlier[1], 138)
        assert killed == [signal.SIGUSR1]
        assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)] == earlier
    finally:
        for s, h in zip((signal.SIGTERM, signal.SIGUSR1), saved):
            signal.signal(s, h)
