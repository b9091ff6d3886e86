"""Experiment loggers: W&B (offline unless asked), CSV, or none.

W&B never blocks or fails for lack of network: the default mode is offline (runs are written
under the run folder and can be synced later); WANDB_MODE in the environment wins over the
config, as wandb itself documents.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def build_logger(logger_cfg: Any, run_dir: Path, project: str, name: str, group: str,
                 tags: list[str], config: dict, run_id: str | None = None):
    """run_id: the W&B run id (train.run passes the run folder's, so a continued run logs into the
    same W&B run)."""
    kind = logger_cfg.name
    if kind == "none":
        return False
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(run_dir), name="csv", version="")
    from lightning.pytorch.loggers import WandbLogger

    mode = os.environ.get("WANDB_MODE") or logger_cfg.get("mode", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbLogger(project=project, name=name, group=group, tags=tags, save_dir=str(run_dir),
                       mode=mode, entity=logger_cfg.get("entity"), config=config,
                       reinit=True, id=run_id, resume="allow" if run_id else None)


def finish_logger(logger, results: dict | None = None) -> None:
    """Copy results.json's scalars (status, test_bleu, ...) into the W&B run summary, so the
    dashboard and `report --wandb` see diverged / failed runs too; then close the run so each
    multirun job is its own finished run."""
    if logger and type(logger).__name__ == "WandbLogger":
        import wandb

        if wandb.run is not None:
            wandb.run.summary.update({k: v for k, v in (results or {}).items()
                                      if isinstance(v, (str, int, float, bool)) or v is None})
            wandb.finish()
