"""A job that raises is a result too: results.json with status "failed" and the error.

Hydra's basic launcher runs multirun jobs one after another in one process and stops the whole
sweep at the first exception. A study of 40 arms should not die because one arm has a bad value
or crashes at step 900, so train.py's main catches the exception, records it here and:
- in a multirun job returns normally, so the sweep continues (the report shows the cell as failed);
- in a single run re-raises, so the command exits non-zero as a user expects.
KeyboardInterrupt / SystemExit are never caught (Ctrl-C stops a sweep).
"""
from __future__ import annotations

import json
import logging
import os
import traceback
from pathlib import Path

from omegaconf import DictConfig

from normlab.json_file import json_object

log = logging.getLogger("normlab")


def is_multirun_job() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def record_failure(cfg: DictConfig, err: BaseException) -> bool:
    """Write (or complete) results.json with status "failed"; True if the caller should go on."""
    from normlab.outcome import FINISHED
    from normlab.run_folder import held_elsewhere, held_here, hydra_choices, run_dir_of

    _merge_start_model(cfg)  # named as train.run names it, also when it failed before merging
    run_dir = run_dir_of(cfg)
    # Why nothing is written, in a sweep's log; a single run's error line is all its user needs
    # (a second `error:` line about the folder would read as a second error)
    note = log.error if is_multirun_job() else log.debug
    if _belongs_to_another_run(Path(run_dir), cfg):
        note("%s holds another run: its results.json is left as it is", run_dir)
    elif held_elsewhere(Path(run_dir)) and not held_here(Path(run_dir)):  # the same run training in another
        # process (a bad rerun beside it); a failed job holds its own folder until this record is written
        note("%s is in use by another process: nothing written there", run_dir)
    elif _status(Path(run_dir)) in FINISHED:  # a finished run stays finished (a typo in its rerun)
        note("%s holds a finished run: its results.json is left as it is", run_dir)
    elif int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:  # one writer under DDP
        path = Path(run_dir) / "results.json"
        old = json_object(path)[0] or {}  # run() may have written steps etc. (damaged: replaced)
        tb = traceback.format_exception(type(err), err, err.__traceback__)
        results = {**old, "status": "failed", "error": f"{type(err).__name__}: {err}",
                   "traceback": "".join(tb[-12:]), "run_dir": str(run_dir), "choices": hydra_choices(),
                   "seed": cfg.get("seed")}
        try:
            from normlab.identity import run_name

            results.setdefault("name", run_name(cfg))
            results.setdefault("group", str(cfg.get("group")))
        except Exception:  # an interpolation that itself fails (e.g. a bad choice)
            pass
        try:
            from normlab.checkpoint import write_json

            Path(run_dir).mkdir(parents=True, exist_ok=True)
            write_json(path, results)
        except OSError as io_err:
            log.error("could not write %s: %s", path, io_err)
    if is_multirun_job():
        log.error("job failed, the sweep goes on: %s: %s (details in results.json)", type(err).__name__, err)
        return True
    return False


def _status(run_dir: Path) -> str | None:
    return (json_object(run_dir / "results.json")[0] or {}).get("status")


def _merge_start_model(cfg: DictConfig) -> None:
    """resume= / finetune=: the start checkpoint's model, as train.run merges it (best effort: an
    unreadable checkpoint is the failure being recorded)."""
    try:
        from normlab.run_spec import apply_start_model

        apply_start_model(cfg)
    except Exception:
        pass


def _belongs_to_another_run(run_dir: Path, cfg: DictConfig) -> bool:
    """A folder whose run.json names another identity (an explicit run_dir reused for another config)."""
    from normlab.run_folder import RUN_FILE

    record = run_dir / RUN_FILE
    if not record.is_file():
        return False
    try:
        from normlab.identity import identity_hash

        return json.loads(record.read_text()).get("identity_hash") != identity_hash(cfg)
    except Exception:  # an unreadable record or a config that does not resolve: leave the folder alone
        return True
