"""A run resolved once (issue 18): `resolve(cfg)` merges the start checkpoint's model into the
composed config (read once), validates it once, and computes what names the run (identity, hash,
name, labels, tags, W&B group, folder) once, before the run's folder is touched. train.run takes the
frozen RunSpec; nothing below it recomputes a name or re-reads the start checkpoint's model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from normlab import identity
from normlab.config import ConfigError, check_machine, validate_run_config
from normlab.run_folder import hydra_choices, run_dir_of, start_model


@dataclass(frozen=True)
class RunSpec:
    cfg: DictConfig            # the composed config, the start checkpoint's model merged in
    run_dir: Path
    name: str                  # W&B name = the folder's name part
    group: str                 # W&B group: the sweep's folder, the experiment, or "default"
    tags: tuple[str, ...]
    labels: dict[str, str]     # the report's row values (identity.labels)
    choices: dict[str, Any]    # the Hydra choices as typed
    identity: dict[str, Any]
    identity_hash: str
    start: str | None          # resume= / finetune= as given
    finetune: bool             # finetune=: the weights only; optimizer, schedule and step afresh
    resume: bool               # resume= (without finetune=): continue another run's full checkpoint
    retrain: bool


def resolve(cfg: DictConfig) -> RunSpec:
    """The run `cfg` describes, validated (one ConfigError naming the key) before any work."""
    apply_start_model(cfg)
    try:
        validate_run_config(cfg)  # fails before any data is read, naming the key
    except ConfigError as e:
        raise _not_combined(cfg, e) from None
    check_machine(cfg)
    choices = hydra_choices()
    return RunSpec(cfg=cfg, run_dir=run_dir_of(cfg), name=identity.run_name(cfg), group=_group(cfg),
                   tags=tuple(identity.tags(cfg, choices, identity.typed_overrides(cfg))), labels=identity.labels(cfg),
                   choices=choices, identity=identity.identity(cfg), identity_hash=identity.identity_hash(cfg),
                   start=identity.start_checkpoint(cfg), finetune=bool(cfg.get("finetune")),
                   resume=bool(cfg.get("resume")) and not cfg.get("finetune"), retrain=bool(cfg.get("retrain")))


def apply_start_model(cfg: DictConfig) -> None:
    """resume= / finetune=: the checkpoint's model settings replace the config's, so the run is
    built, named (identity.py) and tagged as the model it continues."""
    values = start_model(cfg)
    with open_dict(cfg):
        for key, value in values.items():
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)


def _group(cfg: DictConfig) -> str:
    from hydra.core.hydra_config import HydraConfig

    group = cfg.get("group")
    if not group and HydraConfig.initialized():  # a sweep groups by its folder, a run by its experiment
        hc = HydraConfig.get()
        group = Path(hc.sweep.dir).name if hc.mode.name == "MULTIRUN" else hc.runtime.choices.get("experiment")
    return str(group or "default")


def _not_combined(cfg: DictConfig, err: ConfigError) -> ConfigError:
    """A model setting typed on the command line that does not combine with the start checkpoint's
    model: the error names the checkpoint and the typed keys (the values it lists are both's)."""
    start = identity.start_checkpoint(cfg)
    if not start:
        return err
    model_keys = ("model", "norm", "regularizer", "init", "data.vocab_size")
    typed = [o.lstrip("+~") for o in identity.typed_overrides(cfg)
             if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] in model_keys
             or o.lstrip("+~").startswith("data.vocab_size=")]
    key = "finetune" if cfg.get("finetune") else "resume"
    return ConfigError(f"{key}={start}", f"the checkpoint's model and the command line's {' '.join(typed) or 'settings'} "
                                         f"do not combine: {err}")
