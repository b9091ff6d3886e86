"""A run resolved once (issue 18): `resolve(cfg)` merges the start checkpoint's model into the
composed config (read once), validates it once, and computes what names the run (identity, hash,
name, labels, tags, W&B group, folder) and every value the run needs (model, optimizer, evaluation,
final passes, tokens per update, seed) once, before the run's folder is touched. train._run takes
the frozen RunSpec and reads no raw config: what it builds through Hydra (the data module, the
Trainer, the callbacks, the loggers) it gets as those objects' own `_target_` nodes, and nothing
below it recomputes a name or re-reads the start checkpoint's model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from normlab import identity
from normlab.budget import budget_notes, trainer_overrides
from normlab.config import ConfigError, ModelConfig
from normlab.run_config import check_machine, model_config_from_hydra, optim_and_eval, validate_run_config
from normlab.run_folder import hydra_choices, run_dir_of, start_model
from normlab.settings import EvalSpec, OptimSpec


@dataclass(frozen=True)
class FinalPasses:
    """What a finished run is scored with (final_test.py), resolved from `eval` and the step
    checkpoints' `keep_last_n`."""
    test: bool                 # eval.test: score the test split at all
    greedy: bool               # eval.test_greedy, and the test decoder differs from validation's
    average_last_n: int        # eval.test_average: average this many step checkpoints (0: no pass)
    decoders: dict[str, dict]  # {"valid": ..., "test": ...}: the decoder settings, for results.json

    @classmethod
    def of(cls, ev: EvalSpec, keep_last_n: int) -> "FinalPasses":
        valid, test = ev.valid_decoding, ev.test_decoding
        return cls(test=ev.test, greedy=ev.test_greedy and test != valid,
                   average_last_n=int(keep_last_n or 0) if ev.test_average else 0,
                   decoders={"valid": valid, "test": test})


@dataclass(frozen=True)
class RunSpec:
    run_dir: Path
    name: str                  # W&B name = the folder's name part
    group: str                 # W&B group: a study's (study-<name>), the sweep's folder, the experiment, or "default"
    tags: tuple[str, ...]
    labels: dict[str, str]     # the report's row values (identity.labels)
    choices: dict[str, Any]    # the Hydra choices as typed
    identity: dict[str, Any]
    identity_hash: str
    start: str | None          # resume= / finetune= as given
    finetune: bool             # finetune=: the weights only; optimizer, schedule and step afresh
    resume: bool               # resume= (without finetune=): continue another run's full checkpoint
    retrain: bool
    seed: int
    project: str               # the W&B project
    model: ModelConfig         # the model's settings; the vocabulary and special ids come from the data
    optim: OptimSpec           # the module's optimizer, schedule and loss settings (settings.py)
    eval: EvalSpec             # the module's decoders and validation settings
    final: FinalPasses
    compile: Any               # model.compile: false, true or a backend
    max_steps: int
    max_time: Any              # trainer.max_time as given (None: no cap); preemption stops at it
    trainer_overrides: dict[str, Any]  # accumulation and val_check_interval from the token budget (budget.py)
    budget_notes: tuple[tuple[int, str], ...]  # (log level, line) on the tokens per update, printed by the run
    config: dict[str, Any]     # the whole resolved config (W&B's run config)
    # Hydra nodes of the objects the run builds (instantiated by train._run, never read):
    data: DictConfig
    trainer: DictConfig
    callbacks: DictConfig | None
    loggers: DictConfig | None


def resolve(cfg: DictConfig) -> RunSpec:
    """The run `cfg` describes, validated (one ConfigError naming the key) before any work."""
    apply_start_model(cfg)
    try:
        validate_run_config(cfg)  # fails before any data is read, naming the key
    except ConfigError as e:
        raise _not_combined(cfg, e) from None
    check_machine(cfg)
    choices = hydra_choices()
    optim, ev = optim_and_eval(cfg)
    keep_last_n = OmegaConf.select(cfg, "callbacks.step_checkpoints.keep_last_n", default=0)
    tokens = (cfg.trainer, cfg.data.max_tokens, optim.tokens_per_update)
    budget = trainer_overrides(*tokens)
    model = model_config_from_hydra(cfg)
    return RunSpec(run_dir=run_dir_of(cfg), name=identity.run_name(cfg), group=_group(cfg),
                   tags=tuple(identity.tags(cfg, choices, identity.typed_overrides(cfg))), labels=identity.labels(cfg),
                   choices=choices, identity=identity.identity(cfg), identity_hash=identity.identity_hash(cfg),
                   start=identity.start_checkpoint(cfg), finetune=bool(cfg.get("finetune")),
                   resume=bool(cfg.get("resume")) and not cfg.get("finetune"), retrain=bool(cfg.get("retrain")),
                   seed=int(cfg.seed), project=str(cfg.project), model=model,
                   optim=optim, eval=ev, final=FinalPasses.of(ev, keep_last_n),
                   compile=cfg.model.get("compile", False), max_steps=int(cfg.trainer.max_steps),
                   max_time=cfg.trainer.get("max_time"), trainer_overrides=budget,
                   budget_notes=budget_notes(*tokens, model.max_positions),
                   config=identity.plain(cfg),
                   data=cfg.data, trainer=cfg.trainer, callbacks=cfg.get("callbacks"), loggers=cfg.get("logger"))


def apply_start_model(cfg: DictConfig) -> None:
    """resume= / finetune=: the checkpoint's model settings replace the config's, so the run is
    built, named (identity.py) and tagged as the model it continues."""
    values = start_model(cfg)
    with open_dict(cfg):
        for key, value in values.items():
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)


def _group(cfg: DictConfig) -> str:
    from hydra.core.hydra_config import HydraConfig

    study = OmegaConf.select(cfg, "labels.study", default=None)  # a study's run (normlab-study): its group
    group = cfg.get("group") or (identity.study_group(study, OmegaConf.select(cfg, "labels.budget")) if study else None)
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
