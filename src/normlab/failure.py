"""A job that raises is a result too: results.json with status "failed" and the error.

Hydra's basic launcher runs multirun jobs one after another in one process and stops the whole
sweep at the first exception. A study of 40 arms should not die because one arm has a bad value
or crashes at step 900, so train.py's main catches the exception, records it here and:
- in a multirun job returns normally, so the sweep continues (the report shows the cell as failed);
- in a single run re-raises, so the command exits non-zero as a user expects.
KeyboardInterrupt / SystemExit are never caught (Ctrl-C stops a sweep).
"""
from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path

from omegaconf import DictConfig

from normlab.json_file import json_object
from normlab.run_identity import RunIdentity, Runtime, choices_of, identify

log = logging.getLogger("normlab")


def record_failure(cfg: DictConfig, err: BaseException, runtime: Runtime | None = None) -> bool:
    """Write (or complete) results.json with status "failed"; True if the caller should go on. `runtime`:
    the job's (run_identity.hydra_runtime); None outside Hydra."""
    from normlab.outcome import FINISHED
    from normlab.run_folder import held_elsewhere, held_here

    runtime = Runtime.of(cfg) if runtime is None else runtime
    ident = _identified(cfg, runtime)  # as the run named it, also when it failed before it resolved
    run_dir = ident.folder if ident is not None else Path(runtime.output_dir) if runtime.output_dir else None
    # Why nothing is written, in a sweep's log; a single run's error line is all its user needs
    # (a second `error:` line about the folder would read as a second error)
    note = log.error if runtime.multirun else log.debug
    if run_dir is None:
        note("the run's folder is unknown (its config does not resolve): no results.json written")
    elif _belongs_to_another_run(Path(run_dir), ident):
        note("%s holds another run: its results.json is left as it is", run_dir)
    elif held_elsewhere(Path(run_dir)) and not held_here(Path(run_dir)):  # the same run training in another
        # process (a bad rerun beside it); a failed job holds its own folder until this record is written
        note("%s is in use by another process: nothing written there", run_dir)
    elif _status(Path(run_dir)) in FINISHED:  # a finished run stays finished (a typo in its rerun)
        note("%s holds a finished run: its results.json is left as it is", run_dir)
    elif int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:  # one writer under DDP
        _write(Path(run_dir), cfg, err, runtime, ident)
    if runtime.multirun:
        log.error("job failed, the sweep goes on: %s: %s (details in results.json)", type(err).__name__, err)
        return True
    return False


def _write(run_dir: Path, cfg: DictConfig, err: BaseException, runtime: Runtime, ident: RunIdentity | None) -> None:
    path = run_dir / "results.json"
    old = json_object(path)[0] or {}  # run() may have written steps etc. (damaged: replaced)
    tb = traceback.format_exception(type(err), err, err.__traceback__)
    results = {**old, "status": "failed", "error": f"{type(err).__name__}: {err}",
               "traceback": "".join(tb[-12:]), "run_dir": str(run_dir), "choices": choices_of(runtime),
               "seed": cfg.get("seed")}
    if ident is not None:
        results.setdefault("name", ident.name)
        results.setdefault("group", ident.group)
    try:
        from normlab.checkpoint import write_json

        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(path, results)
    except OSError as io_err:
        log.error("could not write %s: %s", path, io_err)


def _status(run_dir: Path) -> str | None:
    return (json_object(run_dir / "results.json")[0] or {}).get("status")


def _identified(cfg: DictConfig, runtime: Runtime) -> RunIdentity | None:
    """The run's identity (computed before in this process: the folder's resolver or train.run named
    it), or None for a config that does not resolve (e.g. an interpolation that itself fails)."""
    try:
        return identify(cfg, runtime)
    except Exception:
        return None


def _belongs_to_another_run(run_dir: Path, ident: RunIdentity | None) -> bool:
    """A folder whose run.json names another identity (an explicit run_dir reused for another config);
    with a config that does not resolve, any run.json (the folder is left alone)."""
    from normlab.run_folder import RUN_FILE, holds_run

    if not (run_dir / RUN_FILE).is_file():
        return False
    return ident is None or not holds_run(run_dir, ident.hash)
