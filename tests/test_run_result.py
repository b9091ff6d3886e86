"""A run returns one RunResult (issue 37 item 3): results.json is its record, the W&B summary and
the Hydra sweeper's objective are read from it, and a tiny run writes the record today's code wrote
before it existed (the keys, and every value that is the same on any machine: main at 965b040)."""
import json
from pathlib import Path

import pytest

from normlab.loggers import wandb_summary
from normlab.outcome import Status
from normlab.run_result import RunResult, objective

from conftest import CONF, compose_cfg, tiny_overrides

# results.json of `tiny_overrides` as main wrote it at 965b040, before RunResult (38 keys)
KEYS_BEFORE = {
    "bleu_signature", "checkpoint", "choices", "chrf_signature", "code", "code_legs", "cpu", "cpu_s", "decoders",
    "device", "group", "identity_hash", "input_independent_loss", "labels", "name", "params", "planned_steps",
    "run_dir", "seed", "status", "steps", "test_bleu", "test_bleu_avg", "test_bleu_greedy", "test_chrf",
    "test_chrf_greedy", "test_loss", "test_nll", "test_ppl", "train_tokens_per_s", "valid_bleu", "valid_chrf",
    "valid_loss", "valid_nll", "valid_ppl", "wall_s"}
DECODER = {"lenpen": 0.6, "max_len_a": 1.0, "max_len_b": 50, "min_len": 0}
VALUES_BEFORE = {  # the same on any machine: what the config, the data and the seed decide
    "status": "completed", "steps": 8, "planned_steps": 8, "params": 52480, "seed": 1, "group": "default",
    "choices": {}, "test_bleu_avg": None,  # one step checkpoint in 8 steps: nothing to average
    "labels": {"aggregation": "none", "arm": "pre_ln", "attention": "none", "data": "bible_de_en", "init": "xavier",
               "norm": "pre_ln", "regularizer": "none"},
    "decoders": {"test": {"beam": 4, **DECODER}, "valid": {"beam": 1, **DECODER}}}
FLOOR_BEFORE = 5.068638125568299  # input_independent_loss: L* of the training targets (float64 sums)

RECORD = {"status": "stalled", "run_dir": "/r", "name": "n-1a2b3c4d", "group": "g", "seed": 3, "identity_hash": "1a2b3c4d",
          "choices": {"norm": "postnorm"}, "labels": {"norm": "post_ln"}, "device": "cpu: x", "cpu": {"isa": "avx2"},
          "code": {"commit": None}, "code_legs": [{"from_step": 0}], "steps": 40, "planned_steps": 100, "params": 9,
          "train_tokens_per_s": 1.5, "wall_s": 2.0, "cpu_s": None, "stall_loss": 6.6, "stall_reason": "flat",
          "input_independent_loss": 6.5, "stopped_at_step": 40, "valid_loss": 6.7, "valid_bleu": None,
          "test_loss": 6.8, "decoders": {"valid": {"beam": 1}}, "plateau": {"improving": False}, "a_new_score": 1}


def test_a_record_is_its_parts_and_back():
    result = RunResult.from_record(RECORD)
    assert result.status is Status.STALLED
    assert result.reasons == {"stall_loss": 6.6, "stall_reason": "flat", "input_independent_loss": 6.5,
                              "stopped_at_step": 40}
    assert set(result.counters) == {"steps", "planned_steps", "params", "train_tokens_per_s", "wall_s", "cpu_s"}
    assert set(result.provenance) == {"run_dir", "name", "group", "seed", "identity_hash", "choices", "labels",
                                      "device", "cpu", "code", "code_legs"}
    assert set(result.scores) == {"valid_loss", "valid_bleu", "test_loss", "decoders", "plateau", "a_new_score"}
    assert result.record == RECORD and result == RECORD and dict(result) == RECORD  # a read-only Mapping of it
    assert result["stall_reason"] == "flat" and "test_bleu" not in result and result.get("test_bleu") is None
    assert result | {"x": 1} == {**RECORD, "x": 1}
    with pytest.raises(TypeError):
        result["status"] = "completed"


def test_the_status_is_the_last_word_of_the_record():
    """A part cannot hold a status of its own: the record's is the RunResult's."""
    assert RunResult(Status.INTERRUPTED, scores={"status": "completed"})["status"] == "interrupted"


def test_the_w_and_b_summary_and_the_objective_are_read_from_the_result():
    result = RunResult.from_record(RECORD)
    assert result.summary() == wandb_summary(RECORD)
    assert result.summary()["valid/loss"] == 6.7 and result.summary()["stall_reason"] == "flat"
    assert result.objective() == objective(RECORD) == 0.0  # stalled, not decoded: the BLEU of its floor
    done = RunResult(Status.COMPLETED, scores={"valid_bleu": 21.5})
    assert done.objective() == 21.5 and RunResult(Status.FAILED, reasons={"error": "x"}).objective() is None


@pytest.mark.integration
def test_a_tiny_runs_results_json_has_the_keys_and_values_it_had(small_corpus, tmp_path):
    from normlab import identity
    from normlab.train import run

    run_dir = tmp_path / "run"
    cfg = compose_cfg(tiny_overrides(small_corpus, run_dir, tmp_path / "cache"))
    result = run(cfg)
    saved = json.loads((run_dir / "results.json").read_text())
    assert set(saved) == KEYS_BEFORE
    assert {k: saved[k] for k in VALUES_BEFORE} == VALUES_BEFORE
    assert saved["input_independent_loss"] == pytest.approx(FLOOR_BEFORE, rel=1e-12)
    assert saved["identity_hash"] == identity.identity_hash(cfg) and saved["name"] == f"tiny-test-{saved['identity_hash']}"
    assert saved["run_dir"] == str(run_dir) and saved["checkpoint"] == str(run_dir / "checkpoints" / "best-step4.ckpt")
    assert [leg["from_step"] for leg in saved["code_legs"]] == [0] and set(saved["code"]) == {"commit", "dirty", "python",
                                                                                             "torch"}
    scores = [k for k in KEYS_BEFORE if k.startswith(("valid_", "test_")) and k != "test_bleu_avg"]
    assert all(isinstance(saved[k], float) for k in scores + ["train_tokens_per_s", "wall_s", "cpu_s"])
    assert saved["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    # the run returned what it wrote, and its summary and objective are read from it
    assert isinstance(result, RunResult) and result.record == saved
    assert result.summary() == wandb_summary(saved) and result.objective() == saved["valid_bleu"]
    assert RunResult.from_record(saved).record == saved
    again = run(compose_cfg(tiny_overrides(small_corpus, run_dir, tmp_path / "cache")))  # finished: read back
    assert isinstance(again, RunResult) and again.record == saved and again.status is Status.COMPLETED


@pytest.mark.integration
@pytest.mark.parametrize("returned, value", [(RunResult(Status.STALLED, scores={"valid_bleu": None}), 0.0),
                                             (RunResult(Status.COMPLETED, scores={"valid_bleu": 12.5}), 12.5),
                                             (RunResult(Status.DIVERGED, scores={}), None)])
def test_the_hydra_job_returns_the_results_objective(returned, value, tmp_path, monkeypatch):
    """commands.train.task, the Hydra job an Optuna sweeper calls: its return value is the objective of
    the RunResult the run returned (train.run_resolved replaced: this is about the job, not training)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    import normlab.train as train_mod
    from normlab.commands import train as command

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hydra.run.dir={tmp_path}/run", "logger=csv"],
                      return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir, cfg.hydra.job.name = str(tmp_path / "run"), "train"
    monkeypatch.setattr(HydraConfig.instance(), "cfg", HydraConfig.instance().cfg)  # put back afterwards
    HydraConfig.instance().set_config(cfg)
    monkeypatch.setattr(train_mod, "run_resolved", lambda spec: returned)  # the job resolves, then runs the RunSpec
    assert command.task(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])) == value
    assert (Path(tmp_path) / "run" / ".hydra" / "config.yaml").is_file()  # it was the job, folder held and recorded
