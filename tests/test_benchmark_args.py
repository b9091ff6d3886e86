"""The benchmark scripts reject bad arguments with an argparse error (exit code 2) before running
anything: --repeats below 1 (train_throughput.py) and unknown --settings names (profile_step.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str, monkeypatch):
    """benchmarks/<name>.py as a module; its sys.path additions are undone after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def no_benchmark(*a, **k):
        raise AssertionError("the benchmark ran: the argument was not rejected first")

    for fn in ("synthetic_batches", "corpus_batches", "matmul_peak", "build"):
        monkeypatch.setattr(mod.P, fn, no_benchmark)
    return mod


def exit_message(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("repeats", ["0", "-1"])
def test_train_throughput_rejects_repeats_below_one(repeats, monkeypatch, capsys):
    mod = load("train_throughput", monkeypatch)
    err = exit_message(mod.main, ["--repeats", repeats], capsys)
    assert f"--repeats: {repeats}; must be at least 1" in err


def test_profile_step_rejects_unknown_settings(monkeypatch, capsys):
    mod = load("profile_step", monkeypatch)
    monkeypatch.setattr(mod, "instrument", lambda: pytest.fail("instrumented before checking --settings"))
    err = exit_message(mod.main, ["--settings", "none,bogus"], capsys)
    assert "--settings: 'bogus'; allowed: " + ", ".join(mod.P.SETTING_TEXT) in err
    assert "papers_model" in err and "none_model" in err


def test_model_alone_runs_take_their_turn_beside_their_peers(monkeypatch):
    """train_throughput's turn order: each dropout setting's runs together, normlab on full logits
    (papers_model, none_model) right after the peers of its setting, so its ratios pair adjacent steps."""
    import types

    import torch

    mod = load("train_throughput", monkeypatch)
    monkeypatch.setattr(mod.P, "build", lambda cls, shape, setting, compile=False: types.SimpleNamespace(
        model=torch.nn.Linear(1, 1), tag=(cls.name, setting)))
    settings = ["papers", "everywhere", "none", "papers_model", "none_model"]
    runs, by_setting = mod.build(settings, [c.name for c in mod.P.PEERS], None, torch.device("cpu"), False)
    order = [r["peer"].tag for r in runs]
    peers = [c.name for c in mod.P.PEERS]
    assert order == [*[(n, "papers") for n in peers], ("normlab", "papers_model"),
                     *[(n, "everywhere") for n in peers],
                     *[(n, "none") for n in peers], ("normlab", "none_model")]
    assert [r["peer"].tag for r in by_setting["none_model"]] == [("normlab", "none_model"),
                                                                *[(n, "none") for n in peers[1:]]]


def test_stalled_arm_takes_an_arms_overrides_from_the_checkout_it_runs(monkeypatch, tmp_path):
    """stalled_arm.py --before runs the arm as that checkout's study file gives it: here, this
    checkout's (the overrides a study job gets), and a checkout without the arm is one error line."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_stalled_arm", BENCHMARKS / "stalled_arm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from normlab.study.spec import load_study

    study = load_study("deep_bleu")
    assert mod.arm_overrides("deep_bleu", "post_ln", 2) == study.arm_overrides(study.arms["post_ln"], 2)
    with pytest.raises(SystemExit, match=r"^error: .*: the study 'deep_bleu' has no arm 'nope' there \(KeyError"):
        mod.arm_overrides("deep_bleu", "nope", 2)
