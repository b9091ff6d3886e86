"""The Hydra resolvers of conf/hydra: `nl.run_dir` / `nl.run_name` name a run's folder before it
starts, from its identity (identity.py) with a start checkpoint's model merged in (resume= /
finetune=: the run is named as the model it continues; run_folder.start_model reads the
checkpoint); `nl.study` names a sweep's folder (identity.study_id). Registered on import (train.py
imports this module; a submitit worker calls register_resolvers itself)."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from normlab import identity


def _folder_name(root: DictConfig) -> str:
    tree = identity.plain(root)
    if identity.start_checkpoint(root):
        try:
            for key, value in start_model(root).items():
                identity.set_key(tree, key, value)
        except Exception:  # e.g. an unreadable resume= checkpoint: train.run reports it in one line
            tree = identity.plain(root)
    return identity.run_name(tree)


# run_folder (the folders, the checkpoint) imports torch: only when Hydra resolves a run's folder,
# after the command line composed, so `train.py --help` and a bad key answer at once.
def start_model(root: DictConfig) -> dict:
    from normlab.run_folder import start_model as read

    return read(root)


def _existing_name(parent, name: str) -> str:
    from normlab.run_folder import existing_name

    return existing_name(parent, name)


def _resolve_run_name(*, _root_: DictConfig) -> str:
    name = _folder_name(_root_)
    sweep_dir = OmegaConf.select(_root_, "hydra.sweep.dir", default=None)
    return _existing_name(sweep_dir, name) if sweep_dir else name


def _resolve_run_dir(parent: str, *, _root_: DictConfig) -> str:
    given = _root_.get("run_dir")
    return str(given) if given else f"{parent}/{_existing_name(parent, _folder_name(_root_))}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("nl.run_name"):
        OmegaConf.register_new_resolver("nl.run_name", _resolve_run_name)
        OmegaConf.register_new_resolver("nl.run_dir", _resolve_run_dir)
        # cached: computed once on the sweep's own config, copied by Hydra into every job's config
        OmegaConf.register_new_resolver("nl.study", identity.study_id, use_cache=True)


register_resolvers()
