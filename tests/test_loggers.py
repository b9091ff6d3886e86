"""W&B must work with no network: offline by default, one finished run per job."""
import os

from omegaconf import OmegaConf

from normlab.loggers import build_logger, finish_logger


def test_wandb_offline_run_is_written_without_network(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = OmegaConf.create({"name": "wandb", "mode": "offline", "entity": None})
    logger = build_logger(cfg, tmp_path, "normlab-test", "prenorm-x", "grp", ["norm:prenorm", "seed:1"],
                          config={"norm": {"placement": "pre"}})
    logger.log_metrics({"train/loss": 1.5}, step=1)
    run = logger.experiment
    assert run.settings.mode == "offline"
    assert (run.name, run.group) == ("prenorm-x", "grp")
    assert set(run.tags) == {"norm:prenorm", "seed:1"}
    assert run.config["norm"]["placement"] == "pre"
    import wandb

    real_finish = wandb.finish
    monkeypatch.setattr(wandb, "finish", lambda: None)  # read the summary before the run closes
    finish_logger(logger, {"status": "diverged", "test_bleu": None, "steps": 7, "choices": {"norm": "x"}})
    assert run.summary["status"] == "diverged" and run.summary["steps"] == 7 and "choices" not in run.summary.keys()
    monkeypatch.setattr(wandb, "finish", real_finish)
    wandb.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_env_wins_over_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = OmegaConf.create({"name": "wandb", "mode": "online", "entity": None})
    logger = build_logger(cfg, tmp_path, "normlab-test", "n", "g", [], config={})
    assert logger.experiment.settings.mode == "disabled"
    finish_logger(logger)


def test_csv_and_none(tmp_path):
    assert build_logger(OmegaConf.create({"name": "none"}), tmp_path, "p", "n", "g", [], {}) is False
    csv = build_logger(OmegaConf.create({"name": "csv"}), tmp_path, "p", "n", "g", [], {})
    csv.log_metrics({"a": 1.0}, step=0)
    csv.save()
    assert os.path.isfile(tmp_path / "csv" / "metrics.csv")
