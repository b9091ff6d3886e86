"""The resolvers of the config. `nl.val_interval` sets trainer.val_check_interval from
trainer.max_steps (conf/trainer/cpu.yaml). Those of conf/hydra: `nl.run_dir` / `nl.run_name` name a
run's folder before it starts, from its identity (identity.py) with a start checkpoint's model merged in (resume= /
finetune=: the run is named as the model it continues; run_folder.start_model reads the
checkpoint); `nl.study` names a sweep's folder (identity.study_id). Registered on import (train.py
imports this module; a submitit worker calls register_resolvers itself)."""
from __future__ import annotations

import copy
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from normlab import identity


def _folder_names(root: DictConfig) -> tuple[str, str | None]:
    """The run's name, as train.run names it (run_spec.resolve: the start checkpoint's model merged
    into the config, so the keys that interpolate a model key follow it), and, for a run started
    from a checkpoint, the name releases before 2026-11-25 gave its folder (the checkpoint's values
    set on the resolved tree, so an interpolating key such as data.max_positions or
    callbacks.drophead_schedule.p kept the config's value): a folder of that name still continues."""
    if not identity.start_checkpoint(root):
        return identity.run_name(root), None
    try:
        values = start_model(root)
    except Exception:  # e.g. an unreadable resume= checkpoint: train.run reports it in one line
        return identity.run_name(root), None
    legacy = identity.plain(root)
    for key, value in values.items():
        identity.set_key(legacy, key, value)
    merged = copy.deepcopy(root)
    with open_dict(merged):
        for key, value in values.items():  # as run_spec.apply_start_model
            OmegaConf.update(merged, key, value, merge=False, force_add=True)
    return identity.run_name(merged), identity.run_name(legacy)


def _folder_name(root: DictConfig, parent) -> str:
    name, legacy = _folder_names(root)
    if parent is None or identity.debug_mode(root):
        return name  # a debug run is never continued: not into a folder an earlier release named for it
    found = _existing_name(parent, name)
    if found == name and legacy and legacy != name and not (Path(parent) / name).exists() \
            and _holds(Path(parent) / legacy, name.rsplit("-", 1)[1]):
        return legacy  # a run an earlier release started: it continues in its folder (run.json has its hash)
    return found


def _holds(folder: Path, identity_hash: str) -> bool:
    """Whether `folder`'s run.json records this identity (train.run wrote it with the run's hash)."""
    from normlab.json_file import json_object

    return (json_object(folder / "run.json")[0] or {}).get("identity_hash") == identity_hash  # damaged: not it


# run_folder (the folders, the checkpoint) imports torch: only when Hydra resolves a run's folder,
# after the command line composed, so `train.py --help` and a bad key answer at once.
def start_model(root: DictConfig) -> dict:
    from normlab.run_folder import start_model as read

    return read(root)


def _existing_name(parent, name: str) -> str:
    from normlab.run_folder import existing_name

    return existing_name(parent, name)


def _resolve_run_name(*, _root_: DictConfig) -> str:
    return _folder_name(_root_, OmegaConf.select(_root_, "hydra.sweep.dir", default=None))


def _resolve_run_dir(parent: str, *, _root_: DictConfig) -> str:
    given = _root_.get("run_dir")
    return str(given) if given else f"{parent}/{_folder_name(_root_, parent)}"


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


register_resolvers()
