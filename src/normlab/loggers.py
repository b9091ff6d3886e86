"""Experiment loggers from config: any number at once (lightning-hydra-template's many_loggers).

`logger` is a dict of `_target_` nodes (conf/logger/*.yaml); the default is W&B + CSV, so the
dashboard and the report's curves (csv/metrics.csv) both exist whatever else is chosen:
`logger=csv`, `logger=[wandb,csv,tensorboard]`, `+logger=tensorboard` (add one), `logger=none`.
Each logger writes under the run folder (save_dir). W&B also gets the run's name, group, tags and
config, and never blocks or fails for lack of network: the default mode is offline (runs are
written under the run folder and can be synced later); WANDB_MODE in the environment wins over the
config, as wandb itself documents. `run_id` (or logger.wandb.id) makes a rerun continue the same
W&B run. An offline run ends with a line saying where its files are and the `wandb sync` command
that uploads them.
"""
from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from normlab.outcome import REASON_KEYS, Status
from normlab.private_api import drop_wandb_init_key
from normlab.signals import deferred
from normlab.wandb_files import wait_until_finished

log = logging.getLogger("normlab")


def _is_wandb(logger_or_cls) -> bool:
    cls = logger_or_cls if isinstance(logger_or_cls, type) else type(logger_or_cls)
    return any(c.__name__ == "WandbLogger" for c in cls.__mro__)


def build_loggers(logger_cfg: Any, run_dir: Path, project: str, name: str, group: str, tags: list[str],
                  config: dict, run_id: str | None = None) -> list:
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    loggers = []
    for node in (logger_cfg or {}).values():
        if node is None:
            continue
        kwargs = OmegaConf.to_container(node, resolve=True)
        cls = get_class(kwargs.pop("_target_"))
        if _is_wandb(cls):
            os.environ.setdefault("WANDB_SILENT", "true")
            kwargs = {"project": project, "name": name, "group": group, "tags": tags, "config": config,
                      **kwargs, "mode": os.environ.get("WANDB_MODE") or kwargs.get("mode") or "offline",
                      "reinit": True}
            if run_id or kwargs.get("id"):
                kwargs.update(id=run_id or kwargs["id"], resume="allow")
        if "save_dir" in inspect.signature(cls.__init__).parameters:
            kwargs.setdefault("save_dir", str(run_dir))
        logger = cls(**kwargs)
        if _is_wandb(cls):  # Lightning passes anonymous=None, which wandb warns about on every run
            drop_wandb_init_key(logger, "anonymous")
            if run_id or kwargs.get("id"):  # a continued run: its earlier legs' files are read
                _log_each_step_once(logger, Path(kwargs.get("save_dir") or run_dir) / "wandb")
        loggers.append(logger)
    return loggers


def _log_each_step_once(logger, wandb_dir: Path) -> None:
    """A continued run replays the steps between its checkpoint and the kill (or crash); the CSV
    history is trimmed to the checkpoint (run_folder.restore_csv_histories), but a W&B run only
    appends. So the W&B logger skips the steps the earlier legs' run files hold (the replay logs the
    same values: continuation is exact)."""
    from lightning.pytorch.utilities import rank_zero_only

    from normlab.wandb_files import last_logged_step

    before, log_metrics = last_logged_step(wandb_dir), logger.log_metrics

    @rank_zero_only  # as Lightning's own log_metrics
    def log_once(metrics, step=None):
        if step is None or step > before:
            log_metrics(metrics, step)

    logger.log_metrics = log_once


SERIES_PREFIXES = ("valid", "test", "train")  # results.json keys that are also a logged series' name


def wandb_summary(results: Mapping[str, Any]) -> dict:
    """Every results.json value (labels, choices, decoders and the other non-scalars included), each
    under one key: a score under the key of its logged series (valid_bleu -> valid/bleu,
    test_bleu_avg -> test/bleu_avg, train_tokens_per_s -> train/tokens_per_s), set to results.json's
    value (the scored checkpoint's, or the whole run's throughput); everything else under its own
    key. `report --wandb` maps the `/` back, so the summary reads as results.json."""
    return {k.replace("_", "/", 1) if k.split("_", 1)[0] in SERIES_PREFIXES else k: v for k, v in results.items()}


def offline_note(run) -> str | None:
    """`W&B offline run: <dir>; upload it with `wandb sync <dir>``, for an offline run (None otherwise).
    A continued run has a folder per leg under one id: all of them, with --id, go into the one run."""
    if not run.offline:
        return None
    here = Path(run.sync_dir)
    legs = sorted(here.parent.glob(f"offline-run-*-{run.id}"))
    sync = f"wandb sync --id {run.id} {here.parent}/offline-run-*-{run.id}" if len(legs) > 1 else f"wandb sync {here}"
    return f"W&B offline run: {here}; upload it with `{sync}`"


def finish_loggers(loggers: list, results: Mapping[str, Any] | None = None) -> None:
    """Copy the run's result (a RunResult, run_result.py: results.json's record) into the W&B run
    summary (so the dashboard and `report --wandb` see diverged / failed runs too), then close each
    run, so each multirun job is its own run."""
    with deferred():  # a signal now (a second SIGTERM) is handled once every logger is closed
        _finish(loggers, results)


def _finish(loggers: list, results: Mapping[str, Any] | None) -> None:
    for logger in loggers or []:
        if _is_wandb(logger):
            import wandb

            if wandb.run is not None:
                summary = wandb_summary(results or {})
                wandb.run.summary.update(summary)
                for key in REASON_KEYS:  # an earlier leg's (preempted, failed) does not outlive it
                    if key not in summary:
                        try:  # offline, a removal record for the sync; a disabled run has no such key
                            del wandb.run.summary[key]
                        except KeyError:
                            pass
                where = offline_note(wandb.run)
                folder = Path(wandb.run.sync_dir) if wandb.run.offline else None
                # W&B's run state says what results.json says: a crash is "failed" in both
                wandb.finish(exit_code=1 if (results or {}).get("status") in (Status.FAILED, Status.INTERRUPTED) else 0)
                if folder is not None:  # the run's file whole before anyone reads it (a continued leg's last step)
                    wait_until_finished(folder)
                if where:
                    log.info(where)
        else:
            logger.finalize("success" if (results or {}).get("status") == Status.COMPLETED else "failed")
