"""The report's input: run folders (results.json + Hydra's files) or W&B runs, as `Run`s."""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

import normlab.resolvers  # noqa: F401  (a run's saved config is unresolved: nl.val_interval reads it)
from normlab.commands.common import CommandError
from normlab.json_file import json_object
from normlab.outcome import FINISHED, UNFINISHED
from normlab.study.records import holding_study

# Statuses a run records itself (normlab/outcome.py): diverged and stalled runs are results, not
# failures; stopped and preempted runs are continued by the same command: shown as what they are.
RESULT_STATUSES = FINISHED
UNFINISHED_STATUSES = UNFINISHED
RUNNING_WINDOW_S = 600  # a job folder without results.json, written to in the last 10 minutes: running


@dataclass
class Run:
    path: Path
    status: str  # completed | diverged | stalled | stopped | preempted | failed (no results.json, any other) | running
    results: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # flat: "model.encoder_layers" -> 6
    choices: dict = field(default_factory=dict)  # Hydra choices: "norm" -> "postnorm", "arm" -> "admin"
    overrides: dict = field(default_factory=dict)
    error: str | None = None

    def get(self, key: str) -> Any:
        # labels (norm, init, regularizer, arm) describe the resolved values that ran; the Hydra
        # choice names only say which file they came from (runs before labels existed fall back to them).
        # A study's record says which study and arm hold the run (`study`): before the labels, which
        # keep the study and arm it was trained as (another study's, for a run two studies share)
        labels = _dict(self.results.get("labels"))
        held = _dict(self.results.get("study"))
        held = {**held, "name": holding_study(self.path, self.results)}  # its folder's: a renamed study's current name
        holder = {k: held[field] for k, field in (("study", "name"), ("arm", "arm")) if held.get(field)}
        for source in (holder, labels, self.choices, self.config, self.results, self.overrides):  # overrides: strings
            if key in source and not isinstance(source[key], dict):
                return source[key]
        return None

    def metric(self, name: str) -> float | None:
        v = self.results.get(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def key_of(run: Run, keys: list[str]) -> tuple:
    """The run's values of `keys` (a table row or column)."""
    return tuple(hashable(run.get(k)) for k in keys)


def fmt_value(v: Any) -> str:
    if v is None:
        return "—"
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def label(values: tuple) -> str:
    return ", ".join(fmt_value(v) for v in values)


def _flat(node: Any, cfg, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, cfg, key + "."))
            continue
        try:  # resolve interpolations one key at a time: ${hydra:...} cannot be resolved here
            v = OmegaConf.to_container(OmegaConf.select(cfg, key), resolve=True) if isinstance(v, (dict, list)) \
                else OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        except Exception:
            pass
        out[key] = v
    return out


def flat_config(path: Path) -> dict:
    cfg = OmegaConf.load(path)
    return _flat(OmegaConf.to_container(cfg, resolve=False), cfg)


def _hydra_choices(job: Path) -> dict:
    path = job / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return {}
    try:
        choices = OmegaConf.select(OmegaConf.load(path), "hydra.runtime.choices")
        return {k: v for k, v in OmegaConf.to_container(choices).items() if "/" not in k and v is not None}
    except Exception:
        return {}


def _overrides(job: Path) -> dict:
    path = job / ".hydra" / "overrides.yaml"
    out = {}
    for line in (OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else []) or []:
        key, sep, value = str(line).partition("=")
        if sep:
            out[key.lstrip("+~")] = value
    return out


def load_run(job: Path) -> Run | None:
    """The job folder as a Run; None, named in one line on stderr, when its results.json is damaged
    (cut off, not JSON, not an object): the report leaves it out, as a missing run, and the file as
    it is."""
    res_path = job / "results.json"
    results, problem = json_object(res_path)
    if problem:
        print(f"warning: {res_path}: {problem}: the run is left out of the report (as missing)", file=sys.stderr)
        return None
    results = results or {}
    config = flat_config(job / ".hydra" / "config.yaml") if (job / ".hydra" / "config.yaml").is_file() else {}
    choices = {**_dict(results.get("choices")), **_hydra_choices(job)}
    status = results.get("status")
    error = results.get("error")
    if not results and time.time() - _last_write(job) < RUNNING_WINDOW_S:
        status, error = "running", "no results.json yet (files written in the last 10 minutes)"
    elif not results:
        status, error = "failed", "no results.json (the job crashed or was killed)"
    elif status in UNFINISHED_STATUSES:
        error = error or f"{status} at step {results.get('steps')} of {results.get('planned_steps')}: rerun the same command"
    elif status not in RESULT_STATUSES:
        error = error or f"status {status!r}"
        status = "failed"
    return Run(job, status, results, config, {k: v for k, v in choices.items() if v is not None},
               _overrides(job), error)


def _last_write(job: Path) -> float:
    return max((p.stat().st_mtime for p in job.rglob("*") if p.is_file()), default=0.0)


def find_runs(roots: list[str]) -> list[Run]:
    jobs: set[Path] = set()
    for root in map(Path, roots):
        if not root.is_dir():
            raise CommandError(f"{root} is not a folder")
        jobs |= {p.parent for p in root.rglob("results.json")}
        jobs |= {p.parent.parent for p in root.rglob(".hydra/config.yaml")}
    return [run for run in map(load_run, sorted(jobs)) if run is not None]


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def wandb_runs(path: str, group: str | None) -> list[Run]:
    """Runs of an online W&B project: config (logged by train.run) and summary as results."""
    try:
        import wandb

        api_runs = wandb.Api().runs(path, filters={"group": group} if group else None)
    except Exception as e:  # no network, no login, no such project
        raise CommandError(f"--wandb {path}: {type(e).__name__}: {e}") from None
    out = []
    for r in api_runs:
        cfg = dict(r.config)
        summary = {k.replace("/", "_"): v for k, v in dict(r.summary).items() if not k.startswith("_")}
        status = summary.get("status") or ("completed" if r.state == "finished" else "failed")
        results = {**summary, "status": status, "seed": cfg.get("seed"), "name": r.name, "group": r.group,
                   "labels": cfg.get("labels") or {}}
        run = Run(Path(f"wandb:{r.path}"), status if status in RESULT_STATUSES else "failed", results,
                  _flat(cfg, OmegaConf.create(cfg)), cfg.get("choices") or {}, {}, None)
        run.error = None if run.status != "failed" else f"W&B state {r.state}"
        out.append(run)
    return out
