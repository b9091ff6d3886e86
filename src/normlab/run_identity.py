"""A run's identity, assembled once (issue 37 item 1): `identify(cfg, runtime) -> RunIdentity` is the
one place that merges a start checkpoint's model into the config (resume= / finetune=: the run is
built, named and tagged as the model it continues), names, tags and groups the run (identity.py's pure
functions) and finds its folder, an older-named one included.

Its callers: Hydra's folder resolvers (resolvers.py: nl.run_dir / nl.run_name, before the job runs),
the run's resolution (run_spec.resolve: the job, or train.run called from Python), a failed job's
record (failure.record_failure) and a study's plan (study/plan.make_job). What identify computes
from a config is kept for the process: the job finds the identity the resolver named its folder with,
so the folder, run.json, results.json and W&B carry one name, and the start checkpoint is read once.

`Runtime` holds what Hydra knows of a job beside its config. Hydra's global state is read in one place,
`hydra_runtime()`, by the training command's job, which passes it down; `Runtime.of(cfg)` reads the
same values from a config composed with its `hydra` node (the node a resolver is given); a run outside
Hydra (train.run from Python, a study's plan) has no choices and no typed overrides.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict

from normlab import identity
from normlab.run_folder import OUTPUTS

# The Hydra choices a run records (results.json `choices`, the W&B config)
CHOICE_GROUPS = ("data", "model", "norm", "regularizer", "init", "optim", "trainer", "logger", "experiment",
                 "arm", "sweep", "debug")


@dataclass(frozen=True)
class Runtime:
    """What Hydra knows of a job beside its config. Nothing below the command reads Hydra's global state."""
    choices: dict[str, Any] = field(default_factory=dict)  # hydra.runtime.choices: the config groups as chosen
    overrides: tuple[str, ...] = ()  # hydra.overrides.task: typed on the command line or set by a sweep
    multirun: bool = False           # a sweep's job (hydra.mode MULTIRUN)
    sweep_dir: str | None = None     # hydra.sweep.dir: the sweep's folder (its jobs' W&B group)
    runs_dir: str | None = OUTPUTS  # where the run's folder is looked for while Hydra has made none
    output_dir: str | None = None    # the folder Hydra made for the job (hydra.runtime.output_dir)
    job_name: str | None = None      # hydra.job.name: Hydra's log file in that folder is <job_name>.log
    record: Any = field(default=None, compare=False, repr=False)  # {hydra: ...}, saved as .hydra/hydra.yaml

    @classmethod
    def of(cls, cfg: Any, **given: Any) -> "Runtime":
        """From a config composed with its `hydra` node (a resolver's root; compose(return_hydra_config=True)),
        else a run outside Hydra; `given` fields (runs_dir, ...) set on top."""
        node = cfg.get("hydra") if OmegaConf.is_config(cfg) else None
        if node is None:
            return cls(**given)
        try:  # multirun/${nl.study:} names a sweep's folder only while a sweep starts (identity.SweepFolder)
            sweep_dir = OmegaConf.select(node, "sweep.dir", default=None)
        except Exception:
            sweep_dir = None
        choices = OmegaConf.select(node, "runtime.choices", default=None)
        task = OmegaConf.select(node, "overrides.task", default=None)
        values = dict(choices=dict(choices) if choices is not None else {},
                      overrides=tuple(task) if task is not None else (),
                      multirun=str(OmegaConf.select(node, "mode", default="")).endswith("MULTIRUN"),
                      sweep_dir=None if sweep_dir is None else str(sweep_dir))
        return cls(**(values | given))


def hydra_runtime() -> Runtime:
    """The Hydra job's runtime values, read from Hydra's global state (through private_api): the one
    place that reads them, called once by the training command's job, which passes them on."""
    from normlab.private_api import hydra_job_config

    job = hydra_job_config()  # {hydra: ...}; None outside a Hydra job
    if job is None:
        return Runtime()
    return Runtime.of(job, output_dir=str(job.hydra.runtime.output_dir), job_name=str(job.hydra.job.name),
                      record=job)


def choices_of(runtime: Runtime) -> dict[str, Any]:
    return {k: runtime.choices.get(k) for k in CHOICE_GROUPS if k in runtime.choices}


@dataclass(frozen=True)
class StartCheckpoint:
    """resume= / finetune=: the value given, the checkpoint file it names and the model settings read
    from it, the keys typed on the command line left out (they keep their typed value)."""
    given: str
    finetune: bool
    path: Path | None = None  # None: not read (error)
    model: dict[str, Any] = field(default_factory=dict)  # {dotted key: value} merged into the config
    error: Exception | None = None  # why it could not be read: the run reports it (run_spec.resolve)


@dataclass(frozen=True)
class RunIdentity:
    name: str                  # <readable part>-<hash>: W&B's, run.json's and results.json's name
    hash: str                  # identity.identity_hash: two runs with one hash are one run
    identity: dict[str, Any]   # the values the hash covers (run.json keeps them)
    labels: dict[str, str]     # the report's row values (identity.labels)
    tags: tuple[str, ...]      # W&B tags (identity.tags)
    group: str                 # W&B group
    choices: dict[str, Any]    # the Hydra choices (choices_of)
    start: StartCheckpoint | None
    legacy_name: str | None = None  # the name releases before 2026-11-25 gave a started run's folder
    config: Any = None         # the caller's config with the start checkpoint's model merged in
    folder: Path | None = None  # the run's folder: Hydra's, run_dir=, or found under runtime.runs_dir


def identify(cfg: Any, runtime: Runtime | None = None) -> RunIdentity:
    """The run `cfg` describes, as `runtime` launches it: named, tagged, grouped, its start checkpoint
    read and merged in, its folder found. Raises only for a config that does not resolve; a start
    checkpoint that cannot be read is in `start.error` (the run is named without its model meanwhile,
    as the folder was).

    A resume= / finetune= run is checked in this order, and refused by the first check it fails (one
    line; tests/test_user_errors.py gives inputs that fail two):
      1. the command line on its own (run_spec._validated: a typed key's own error comes first);
      2. the file: found (a file, or a run folder's checkpoint), readable, a normlab checkpoint, and
         for resume= a full-state one, not weights only (read here, raised by run_spec._validated);
      3. the model the command line builds with the checkpoint's settings (run_spec._not_combined);
      4. the checkpoint against the run, before the data (start_checkpoint.start_point): its tokenizer, for
         resume= the optimizer it trained with, then trainer.max_steps past its step;
      5. its weights against the model (a shape that does not fit), once the model is built."""
    runtime = Runtime.of(cfg) if runtime is None else runtime
    key = _memo_key(cfg, runtime)
    named = _MEMO.get(key)
    if named is None:
        named = _named(cfg, runtime)
        _MEMO[key] = dataclasses.replace(named, config=None)
        while len(_MEMO) > MEMO_SIZE:
            _MEMO.popitem(last=False)
    else:  # named before in this process (Hydra's resolver named the job's folder with it)
        named = dataclasses.replace(named, config=_merged(cfg, named.start))
    return dataclasses.replace(named, folder=_folder(named, runtime))


def folder_name(ident: RunIdentity, parent: str | Path | None) -> str:
    """The name of the run's folder under `parent`: its name, or the folder that holds the run under
    an older name (another readable part with the same hash: run_folder.existing_name; a started run
    as releases before 2026-11-25 named it, whose run.json has the hash). A debug run is never
    continued, so never an older folder."""
    from normlab.run_folder import existing_name, holds_run

    name = ident.name
    if parent is None or ident.labels.get("debug"):
        return name
    found = existing_name(parent, name)
    legacy = ident.legacy_name
    if found == name and legacy and legacy != name and not (Path(parent) / name).exists() \
            and holds_run(Path(parent) / legacy, ident.hash):
        return legacy
    return found


MEMO_SIZE = 16
_MEMO: OrderedDict[str, RunIdentity] = OrderedDict()  # identities computed in this process (without config)


def _memo_key(cfg: Any, runtime: Runtime) -> str:
    """What an identity depends on: the config as composed (unresolved: the resolver's root and the job's
    config resolve `${hydra:runtime.output_dir}` differently, yet are one command), the runtime values
    that name and tag the run, the working directory (relative paths) and the start checkpoint's files
    as they are now (a folder's newest checkpoint changes as its run trains)."""
    tree = OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else dict(cfg)
    tree.pop("hydra", None)  # (no masked_copy: it deep-copies the config first, ~40 ms)
    start = identity.start_checkpoint(cfg)
    return json.dumps([tree, list(runtime.overrides), sorted(runtime.choices.items(), key=lambda kv: kv[0]),
                       runtime.multirun, runtime.sweep_dir if runtime.multirun else None, os.getcwd(),
                       _stamp(start)], sort_keys=True, default=str)


def _stamp(start: Any) -> list | None:
    if not start:
        return None
    out = []
    for p in (Path(str(start)), Path(str(start)) / "checkpoints"):
        try:
            st = p.stat()
            out.append([str(p), st.st_mtime_ns, st.st_size])
        except OSError:
            out.append([str(p), None])
    return out


def _named(cfg: Any, runtime: Runtime) -> RunIdentity:
    start = _read_start(cfg, runtime)
    merged = _merged(cfg, start)
    values = identity.plain(merged)
    name = identity.run_name(values)
    legacy = None
    if start is not None and start.model:
        # releases before 2026-11-25 set the checkpoint's values on the resolved tree, so a key that
        # interpolates a model key (data.max_positions, callbacks.drophead_schedule.p) kept the config's
        old = identity.plain(cfg)
        for key, value in start.model.items():
            identity.set_key(old, key, value)
        legacy = identity.run_name(old)
    return RunIdentity(name=name, hash=identity.identity_hash(values), identity=identity.identity(values),
                       labels=identity.labels(values), tags=tuple(identity.tags(merged, runtime.choices,
                                                                                list(runtime.overrides), values)),
                       group=_group(values, runtime), choices=choices_of(runtime), start=start, legacy_name=legacy,
                       config=merged)


def _read_start(cfg: Any, runtime: Runtime) -> StartCheckpoint | None:
    """The start checkpoint's model settings (run_folder reads the file). A key (or its group) typed on
    the command line keeps its value."""
    given = identity.start_checkpoint(cfg)
    if not given:
        return None
    finetune = bool(cfg.get("finetune"))
    from normlab.run_folder import start_checkpoint_model

    try:
        path, model = start_checkpoint_model(str(given), resume=not finetune)
    except Exception as e:  # unreadable, not found, weights only for resume=: the run names it in one line
        return StartCheckpoint(str(given), finetune, error=e)
    typed = {o.split("=", 1)[0].lstrip("+~") for o in runtime.overrides}
    kept = {k: v for k, v in model.items() if k not in typed and k.split(".", 1)[0] not in typed}
    return StartCheckpoint(str(given), finetune, path, kept)


def _merged(cfg: Any, start: StartCheckpoint | None) -> Any:
    if start is None or not start.model:
        return cfg
    merged = copy.deepcopy(cfg)
    with open_dict(merged):
        for key, value in start.model.items():
            OmegaConf.update(merged, key, value, merge=False, force_add=True)
    return merged


def _group(values: dict, runtime: Runtime) -> str:
    """W&B group: `group` as given, a study's (study-<name>, by its labels: normlab-study), a sweep's
    folder, the experiment preset, else "default"."""
    labels = values.get("labels") or {}
    study = labels.get("study")
    group = values.get("group") or (identity.study_group(study, labels.get("budget")) if study else None)
    if not group:
        group = Path(runtime.sweep_dir).name if runtime.multirun and runtime.sweep_dir else \
            runtime.choices.get("experiment")
    return str(group or "default")


def _folder(ident: RunIdentity, runtime: Runtime) -> Path | None:
    """The folder Hydra made (named by identify through nl.run_dir / nl.run_name, or hydra.run.dir as
    given), else run_dir= as given, else found under runtime.runs_dir (None: no lookup asked for)."""
    if runtime.output_dir:
        return Path(runtime.output_dir)
    given = ident.config.get("run_dir") if ident.config is not None else None
    if given:
        return Path(str(given))
    return None if runtime.runs_dir is None else Path(runtime.runs_dir) / folder_name(ident, runtime.runs_dir)
