"""The resolvers of the config. `nl.val_interval` sets trainer.val_check_interval from
trainer.max_steps (conf/trainer/cpu.yaml). Those of conf/hydra name a run's folder before the job
runs: `nl.run_dir` (a single run: outputs/<folder>) and `nl.run_name` (a sweep job's subfolder), each
from run_identity.identify, which the job then finds computed (one name for the folder, run.json and
W&B); `nl.study` names a sweep's folder (identity.study_id). With them, the submitit launchers'
defaults (launchers.py: one task per device). Registered on import (train.py imports
this module; a submitit worker calls register_resolvers itself)."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from normlab import identity, launchers
from normlab.run_identity import Runtime, folder_name, identify


def _folder_names(root: DictConfig) -> tuple[str, str | None]:
    """The run's name and, for a run started from a checkpoint, the name releases before 2026-11-25
    gave its folder (run_identity.RunIdentity.legacy_name)."""
    ident = identify(root, Runtime.of(root, runs_dir=None))
    return ident.name, ident.legacy_name


def _resolve_run_name(*, _root_: DictConfig) -> str:
    runtime = Runtime.of(_root_, runs_dir=None)  # the folder is looked for under the sweep's, not run_dir=
    return folder_name(identify(_root_, runtime), runtime.sweep_dir)


def _resolve_run_dir(parent: str, *, _root_: DictConfig) -> str:
    given = _root_.get("run_dir")
    return str(given) if given else f"{parent}/{identify(_root_, Runtime.of(_root_, runs_dir=parent)).folder.name}"


VAL_INTERVAL, MIN_VAL_INTERVAL = 500, 5


def val_interval(max_steps) -> int:
    """Validate every 500 optimizer steps, or a quarter of a shorter run (at least 4 validations a
    run of 20 steps or more: a 600-step run validated once at 500, a 200-step run never), and never
    more often than every 5 steps (a 3-step run validated at every step, each a full decode). A
    resolved value, so a run's identity holds the interval it ran with: the CPU default (2,000
    steps) and every study's runs keep 500 and their names."""
    steps = int(max_steps)
    return VAL_INTERVAL if steps <= 0 else max(MIN_VAL_INTERVAL, min(VAL_INTERVAL, steps // 4))


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("nl.val_interval"):
        OmegaConf.register_new_resolver("nl.val_interval", val_interval)
    if not OmegaConf.has_resolver("nl.run_name"):
        OmegaConf.register_new_resolver("nl.run_name", _resolve_run_name)
        OmegaConf.register_new_resolver("nl.run_dir", _resolve_run_dir)
        # cached: computed once on the sweep's own config, copied by Hydra into every job's config
        OmegaConf.register_new_resolver("nl.study", identity.study_id, use_cache=True)
    if not OmegaConf.has_resolver("nl.tasks"):
        OmegaConf.register_new_resolver("nl.tasks", launchers.tasks)
    launchers.register_launcher_defaults()  # hydra/launcher=submitit_*: one task per trainer.devices


register_resolvers()
