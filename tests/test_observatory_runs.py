"""The stability observatory in a run (callbacks/observatory.py): off, nothing is built; on, a tiny run
logs every layer's series at each validation to the CSV log and the W&B offline run, writes the last
values into results.json, and trains exactly what the run without it trains (the same identity)."""
import csv
import json
import os

import pytest

from normlab import identity
from normlab.callbacks.observatory import Observatory
from normlab.train import build_callbacks, run

from conftest import compose_cfg, tiny_overrides, wandb_records

TWO_STEPS = ["trainer.max_steps=2", "trainer.val_check_interval=1", "eval.valid_bleu=false", "eval.test=false"]
BLOCKS = [f"enc.{i}.{s}" for i in range(2) for s in ("self_attn", "ffn")] + \
         [f"dec.{i}.{s}" for i in range(2) for s in ("self_attn", "cross_attn", "ffn")]


def test_off_by_default_builds_nothing():
    cfg = compose_cfg([])
    assert cfg.callbacks.observatory.enabled is False
    assert not any(isinstance(c, Observatory) for c in build_callbacks(cfg.callbacks))
    on = compose_cfg(["callbacks.observatory.enabled=true"])
    assert [type(c) for c in build_callbacks(on.callbacks) if isinstance(c, Observatory)] == [Observatory]
    assert identity.identity_hash(on) == identity.identity_hash(cfg)  # extra logging: the same run


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observatory")
    os.environ["WANDB_MODE"] = "offline"
    out = {}
    for arm, extra in (("on", ["callbacks.observatory.enabled=true", "logger=[wandb,csv]"]), ("off", [])):
        cfg = compose_cfg(tiny_overrides(small_corpus, tmp / arm, tmp / "cache") + TWO_STEPS + extra)
        out[arm] = (run(cfg), tmp / arm)
    return out


def test_results_hold_the_last_validation_per_layer(runs):
    results, run_dir = runs["on"]
    assert json.loads((run_dir / "results.json").read_text()) == results
    observed = results["observatory"]
    assert observed["step"] == 2 and list(observed["layers"]) == BLOCKS
    for name, values in observed["layers"].items():
        attention = "attn" in name
        assert set(values) == {"rms", "max_abs", "kurtosis", "out_rms", "out_max_abs", "grad_norm", "grad_spike"} | (
            {"max_logit", *(f"{s}_h{h}" for s in ("entropy", "sink") for h in range(4))} if attention else set())
        assert values["grad_norm"] > 0 and values["rms"] > 0 and values["max_abs"] >= values["rms"]
    assert "observatory" not in runs["off"][0]
    # what a study's claims read of it (study/records.py obs.<stack>.<statistic>): the blocks' mean, heads first
    from normlab.study.records import observatory_mean

    dec_sinks = [sum(v[f"sink_h{h}"] for h in range(4)) / 4 for b, v in observed["layers"].items()
                 if b.startswith("dec.") and "attn" in b]
    assert dec_sinks and observatory_mean(observed, "obs.dec.sink") == pytest.approx(sum(dec_sinks) / len(dec_sinks))
    kurt = [v["kurtosis"] for v in observed["layers"].values()]
    assert observatory_mean(observed, "obs.all.kurtosis") == pytest.approx(sum(kurt) / len(kurt))


def test_csv_and_wandb_hold_every_layers_series(runs):
    results, run_dir = runs["on"]
    rows = [r for r in csv.DictReader((run_dir / "csv" / "metrics.csv").open()) if r.get("obs_kurtosis/enc.0.ffn")]
    assert [int(r["step"]) for r in rows] == [1, 2]  # each validation, not the sanity check
    last = results["observatory"]["layers"]
    for name in BLOCKS:
        assert float(rows[-1][f"obs_rms/{name}"]) == pytest.approx(last[name]["rms"])
        assert float(rows[-1][f"obs_grad_spike/{name}"]) == pytest.approx(last[name]["grad_spike"])
    assert float(rows[-1]["obs_entropy/dec.1.cross_attn.h3"]) == pytest.approx(last["dec.1.cross_attn"]["entropy_h3"])
    (wfile,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = []
    for rec in wandb_records(wfile):
        if rec.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    series = [h for h in history if "obs_max_logit/enc.0.self_attn" in h]
    assert [h["trainer/global_step"] for h in series] == [1, 2]
    assert set(series[-1]) >= {f"obs_{s}/{name}" for s in ("rms", "max_abs", "kurtosis", "grad_norm") for name in BLOCKS}
    assert series[-1]["obs_sink/enc.1.self_attn.h0"] == pytest.approx(last["enc.1.self_attn"]["sink_h0"])


def test_it_changes_nothing_the_run_trains(runs):
    on, off = runs["on"][0], runs["off"][0]
    assert on["status"] == off["status"] == "completed" and on["identity_hash"] == off["identity_hash"]
    assert on["valid_loss"] == off["valid_loss"]  # step 2's weights: trained after step 1's observation
