"""The benchmark scripts reject bad arguments with an argparse error (exit code 2) before running
anything: --repeats below 1 (train_throughput.py), unknown --settings names (profile_step.py), a bad
--cap, --variants, --study or --arm (scoring_share.py); and the scripts' own arithmetic."""
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


def test_bias_free_variant_is_normlab_without_attention_and_norm_biases(monkeypatch):
    """peers.NormlabNoBias (issue 21's tiny-shape gap): normlab's model without the attention
    projections' and the norms' biases, x-transformers' parameter set; its FFN keeps them. With the
    same seed it computes what normlab computes (those biases start at 0), and the throughput
    comparison times it in turns but never counts it as a peer."""
    import torch

    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.path.insert(0, str(BENCHMARKS))
    import peers as P

    names = {}
    for cls in (P.Normlab, P.NormlabNoBias):  # the tiny shape, where the benchmark measures it
        names[cls] = dict(P.build(cls, P.tiny_shape(), "none_model").model.named_parameters())
    kept = set(names[P.NormlabNoBias])
    assert kept < set(names[P.Normlab])  # only removals
    biases = {n for n in names[P.Normlab] if n.endswith(".bias")}
    assert {n for n in kept if n.endswith(".bias")} == {n for n in biases if n.split(".")[-2] in ("fc1", "fc2")}
    assert set(names[P.Normlab]) - kept == {n for n in biases if n.split(".")[-2] not in ("fc1", "fc2")}
    assert (len(names[P.Normlab]), len(kept)) == (131, 78)  # x-transformers: 80, 2 of them position embeddings
    s = P.small(P.tiny_shape())
    b = P.synthetic_batches(s, 1, torch.device("cpu"))[0]
    losses = []
    for cls in (P.Normlab, P.NormlabNoBias):
        torch.manual_seed(0)
        peer = P.build(cls, s, "none_model")
        peer.model.eval()
        losses.append(peer.loss(b))
    torch.testing.assert_close(losses[0], losses[1])

    spec = importlib.util.spec_from_file_location("bench_tt", BENCHMARKS / "train_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"name": "normlab", "tok_s": [[10.0, 10.0, 10.0]]},
            {"name": P.NormlabNoBias.name, "tok_s": [[12.0, 12.0, 12.0]]},
            {"name": "x-transformers", "tok_s": [[8.0, 8.0, 8.0]]}]
    out = mod.compare(rows, 0)
    assert out["fastest_peer"] == "x-transformers" and out["normlab_over_fastest"] == 1.25
    assert out[f"{P.NormlabNoBias.name}_over_fastest"] == 1.5


@pytest.mark.parametrize("models, message", [
    ("normlab-nobias,x-transformers", "--models: normlab-nobias is timed against normlab and a peer"),
    ("normlab,normlab-nobias", "--models: normlab-nobias is timed against normlab and a peer"),
    ("normlab,x-transformer", "--models: x-transformer; allowed: normlab, x-transformers"),
])
def test_models_without_normlab_and_a_peer_or_unknown_are_refused(models, message, monkeypatch, capsys):
    """Without normlab or without a peer the variant's ratios would all be nan, and a misspelt model
    would be left out silently: refused first."""
    mod = load("train_throughput", monkeypatch)
    assert message in exit_message(mod.main, ["--models", models], capsys)


def test_the_variant_takes_its_turn_next_to_normlab_and_compiles_with_it(monkeypatch):
    """With normlab-nobias: per dropout setting the variant, normlab, the peers; then normlab's
    full-logits run and the variant's (normlab next to its peers and to the variant); --compile
    compiles both normlab models, never a peer."""
    import types

    import torch

    mod = load("train_throughput", monkeypatch)
    monkeypatch.setattr(mod.P, "build", lambda cls, shape, setting, compile=False: types.SimpleNamespace(
        model=torch.nn.Linear(1, 1), tag=(cls.name, setting), compiled=compile))
    names = [c.name for c in mod.P.PEERS] + ["normlab-nobias"]
    runs, _ = mod.build(["none", "none_model"], names, None, torch.device("cpu"), True)
    assert [r["peer"].tag for r in runs] == [
        ("normlab-nobias", "none"), ("normlab", "none"), ("x-transformers", "none"), ("torch.nn.Transformer", "none"),
        ("normlab", "none_model"), ("normlab-nobias", "none_model")]
    assert {r["peer"].tag[0] for r in runs if r["peer"].compiled} == {"normlab", "normlab-nobias"}


def test_hyper_memory_rejects_steps_below_one_and_unknown_shapes(monkeypatch, capsys):
    mod = load("hyper_memory", monkeypatch)
    assert "--steps: 0; must be at least 1" in exit_message(mod.main, ["--steps", "0"], capsys)
    assert "invalid choice: 'deep'" in exit_message(mod.main, ["--shape", "deep"], capsys)
    assert "not allowed with argument --small" in exit_message(mod.main, ["--small", "--shape", "deep_recent"], capsys)
    # the study's shape is read from deep_recent.yaml (12+12, d 64, FFN 256) at its 2,048-token batches
    s = mod.SHAPES["deep_recent"]()
    assert (s.layers, s.d, s.ffn, s.heads, s.batch * s.length) == (12, 64, 256, 4, 2048)


def test_hyper_memory_takes_turns_and_reports_medians_against_add(monkeypatch, capsys):
    # Each model's peak is measured while it is the only one built (a CUDA peak counts every live
    # model), then the timed steps go round the models in turns; the table prints each median and
    # its ratio to add's median from the same run.
    from types import SimpleNamespace

    import torch

    mod = load("hyper_memory", monkeypatch)
    names = list(mod.VARIANTS)
    monkeypatch.setattr(mod.P, "synthetic_batches", lambda *a, **k: [{"src": torch.zeros(2, 3)}])
    monkeypatch.setattr(mod, "PreNorm", lambda shape, residual: SimpleNamespace(
        name=names[list(mod.VARIANTS.values()).index(residual)],
        model=SimpleNamespace(to=lambda d: None, parameters=lambda: [], num_parameters=lambda: 7)))
    monkeypatch.setattr(mod.P, "adam", lambda params, device: None)
    # per model: two warm-ups (built alone for its peak, then built for the turns), then 3 timed steps
    seconds = {"add": [0, 0, 1.0, 3.0, 2.0], "mhc n=4 dynamic": [0, 0, 9.0, 6.0, 5.0]}
    calls = []

    def timed(peer, opt, batch, device):
        calls.append(peer.name)
        return seconds.get(peer.name, [0, 0, 4.0, 4.0, 4.0])[calls.count(peer.name) - 1]

    peaks = {"add": 100, "hyper n=4 static": 150, "hyper n=4 dynamic": 200, "mhc n=4 dynamic": 250}
    monkeypatch.setattr(mod.P, "timed_step", timed)
    monkeypatch.setattr(mod.P, "peak_step_memory", lambda peer, *a: peaks[peer.name] * 2 ** 20)
    mod.main(["--shape", "small", "--steps", "3"])
    assert calls == names + names + names * 3  # a warm-up alone each, a warm-up each, 3 turns
    rows = {line[:20].strip(): line.split()[-4:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["add"] == ["100", "1.00", "2.000", "1.00"]
    assert rows["mhc n=4 dynamic"] == ["250", "2.50", "6.000", "3.00"]  # peak, x add, median, x add
    assert rows["hyper n=4 static"] == ["150", "1.50", "4.000", "2.00"]


def _scoring_share(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_scoring_share", BENCHMARKS / "scoring_share.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "run_variant", lambda *a, **k: pytest.fail("ran before checking its arguments"))
    return mod


@pytest.mark.parametrize("argv, message", [
    (["--cap", "1.2"], "--cap '1.2': max_len_a,max_len_b"),
    (["--cap", "1.2,10.5"], "--cap '1.2,10.5': max_len_a,max_len_b"),
    (["--variants", "before,later"], "--variants 'before,later': a comma-separated list of before, after"),
    (["--arm", "nope"], "--arm nope: not an arm of deep_bleu_2k (allowed: post_ln, pre_ln, "),
    (["--study", "nope"], "--study: study 'nope': no such study"),
])
def test_scoring_share_rejects_bad_arguments_before_running(argv, message, monkeypatch, capsys):
    mod = _scoring_share(monkeypatch)
    assert message in exit_message(mod.main, argv, capsys)


def test_scoring_share_variants_and_its_table(monkeypatch):
    """`before` drops a study's scoring keys (every pass, as make train scores); `after` adds the subset,
    the cap on both decoders and off each extra pass the study reads nowhere; the table splits a run's
    wall time as documented, from the parts the run timed."""
    import argparse

    from normlab.study.spec import load_study

    mod = _scoring_share(monkeypatch)
    ap = argparse.ArgumentParser()
    args = argparse.Namespace(subset=200, cap="1.2,10", shape="study", study="deep_bleu", arm="pre_ln", seed=3)
    study = load_study("deep_bleu")  # it sets the subset, the cap and the passes off itself
    base, read = mod.shape_overrides(args, ap)
    full = study.arm_overrides(study.arms["pre_ln"], 3)
    assert base == [o for o in full if not o.startswith("eval.")] and len(full) - len(base) == 7
    assert "test_bleu" in read and not read & {"test_bleu_greedy", "test_bleu_avg"}
    assert mod.variant_overrides("before", args, read) == []
    cap = ["eval.decoder.max_len_a=1.2", "eval.decoder.max_len_b=10", "eval.test_decoder.max_len_a=1.2",
           "eval.test_decoder.max_len_b=10"]
    off = ["eval.test_greedy=false", "eval.test_average=false"]
    assert mod.variant_overrides("after", args, read) == ["eval.valid_subset=200", *cap, *off]
    # a pass the study reads stays on
    assert mod.variant_overrides("after", args, read | {"test_chrf_avg"}) == ["eval.valid_subset=200", *cap, off[0]]
    args.shape, args.subset = "default", 0
    assert mod.shape_overrides(args, ap) == (["seed=3"], set())
    assert mod.variant_overrides("after", args) == [*cap, *off]
    parts = {"fit": {"total": 100.0}, "validation 50": {"total": 10.0, "decode": 6.0, "bleu": 1.0},
             "validation 100": {"total": 8.0, "decode": 4.0, "bleu": 1.0},
             "final valid": {"total": 5.0, "decode": 3.0, "bleu": 0.5}, "final test": {"total": 12.0, "decode": 11.0},
             "averaging": {"total": 9.0}, "final test_avg": {"total": 7.0, "decode": 6.0}}
    v = {"wall_s": 150.0, "timings": {"order": ["fit", "validation 50", "validation 100", "final valid",
                                                "final test", "averaging", "final test_avg"], "parts": parts}}
    rows, shares = mod.table(v)
    got = {what.split(" (")[0]: s for what, s in rows}
    assert got == pytest.approx({"training steps": 82.0, "validation loss": 6.0, "validation BLEU": 12.0,
                                 "final valid": 5.0, "final test": 12.0, "final test_avg": 7.0,
                                 "checkpoint averaging": 2.0, "other": 150.0 - 100.0 - 24.0 - 2.0})
    assert sum(got.values()) == pytest.approx(150.0)
    assert shares["scoring_s"] == pytest.approx(12.0 + 24.0 + 2.0) and shares["scoring"] == pytest.approx(38 / 150)
    assert shares["validation_loss"] == pytest.approx(6 / 150)


def test_scoring_shares_clock_counts_decoding_to_the_innermost_pass(monkeypatch):
    """The averaged pass runs inside the averaging: its decode is its own, the averaging's total holds it."""
    mod = _scoring_share(monkeypatch)
    now = iter(range(100))
    monkeypatch.setattr(mod.time, "perf_counter", lambda: float(next(now)))
    clock = mod.Clock()
    decode = clock.timed("decode", lambda: None)
    outer = clock.phase(lambda: "averaging", lambda: (decode(), inner()))
    inner = clock.phase(lambda: "final test_avg", lambda: decode())
    outer()
    assert dict(clock.parts["averaging"]) == {"decode": 1.0, "total": 7.0}
    assert dict(clock.parts["final test_avg"]) == {"decode": 1.0, "total": 3.0}
    assert clock.order == ["averaging", "final test_avg"]


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "0,200"], "--sizes '0,200': comma-separated integers >= 1"),
    (["--sizes", "two"], "--sizes 'two': comma-separated integers >= 1"),
    (["--study", "nope"], "--study nope: no experiments/nope/test.ref.gz"),
])
def test_subset_ranks_rejects_bad_arguments(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_subset_ranks", BENCHMARKS / "subset_ranks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert message in exit_message(mod.main, argv, capsys)


def test_subset_ranks_counts_the_pairs_a_subset_orders_otherwise(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_subset_ranks", BENCHMARKS / "subset_ranks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    full = {"a": 10.0, "b": 12.0, "c": 11.0, "d": 11.0}  # c, d tie on the whole set: not a pair
    sub = {"a": 9.0, "b": 10.0, "c": 10.0, "d": 8.0}     # a above d; b = c (a tie counts as swapped)
    total, bad = mod.swapped(full, sub)
    assert total == 5
    assert bad == [("a", "d", -1.0), ("b", "c", 1.0)]


def test_observatory_cost_rejects_zero_steps_and_computes_its_ratios(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_observatory_cost", BENCHMARKS / "observatory_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "one_run", lambda *a: (_ for _ in ()).throw(AssertionError("the benchmark ran")))
    assert "--steps: 0 is not an integer >= 1" in exit_message(mod.main, ["--steps", "0"], capsys)
    out = mod.cost({"off": [{"wall_s": 100.0, "train_tokens_per_s": 1000.0}, {"wall_s": 120.0, "train_tokens_per_s": 900.0}],
                    "on": [{"wall_s": 104.0, "train_tokens_per_s": 990.0}]})
    assert out["median"]["off"] == {"wall_s": 110.0, "train_tokens_per_s": 950.0}
    assert out["run_cost"] == 104.0 / 110.0 - 1 and out["step_cost"] == 950.0 / 990.0 - 1
    assert "observatory_share" not in out  # runs without the hooks' timings: no share claimed
    on = [{"wall_s": 100.0, "train_tokens_per_s": 1.0, "observatory_share": s, "observatory_s": {"step": s * 50,
           "validation": s * 50}} for s in (0.01, 0.03, 0.02)]
    out = mod.cost({"off": [{"wall_s": 100.0, "train_tokens_per_s": 1.0}], "on": on})
    assert out["observatory_share"] == 0.02 and out["observatory_s"] == {"step": 1.0, "validation": 1.0}


def test_observatory_cost_times_each_hook_by_its_kind_and_keeps_what_it_returns():
    spec = importlib.util.spec_from_file_location("bench_observatory_cost", BENCHMARKS / "observatory_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    clock = iter(range(0, 1000, 1))  # perf_counter: 0, 1, 2, ...: each call's time is the ticks it spans
    mod.time = type("T", (), {"perf_counter": staticmethod(lambda: float(next(clock)))})

    class Hooks:
        def on_before_optimizer_step(self, *a):
            return "opt"

        def on_train_batch_end(self, *a):
            next(clock)  # two ticks
            return "end"

        def on_validation_batch_start(self, *a, **k):
            for _ in range(4):
                next(clock)
            return k

    totals = {}
    mod.timed_hooks(Hooks, totals)
    h = Hooks()
    assert h.on_before_optimizer_step(1) == "opt" and h.on_train_batch_end(1) == "end"
    assert h.on_validation_batch_start(1, batch_idx=0) == {"batch_idx": 0}
    assert totals == {"step": 1.0 + 2.0, "validation": 5.0}
