"""A run resolved once (issue 18): `resolve(cfg, runtime)` takes the run's identity
(run_identity.identify: named, tagged, its start checkpoint read and its model merged in, its folder
found; computed once a process, so the job has the identity Hydra named its folder with), validates
the config as it runs once, and computes every value the run needs (model, optimizer, evaluation,
final passes, tokens per update, seed) once, before the run's folder is touched. train._run takes
the frozen RunSpec and reads no raw config: what it builds through Hydra (the data module, the
Trainer, the callbacks, the loggers) it gets as those objects' own `_target_` nodes, and nothing
below it recomputes a name or re-reads the start checkpoint's model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from normlab import identity
from normlab.budget import budget_notes, trainer_overrides
from normlab.config import ConfigError, ModelConfig
from normlab.run_config import Validated, check_machine, validated
from normlab.run_identity import RunIdentity, Runtime, identify
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
    start_path: Path | None    # the checkpoint file it names (run_folder.start_checkpoint_path, resolved once)
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


def resolve(cfg: DictConfig, runtime: Runtime | None = None) -> RunSpec:
    """The run `cfg` describes, as `runtime` launches it (None: outside Hydra, or the hydra node `cfg`
    was composed with), validated (one ConfigError naming the key) before any work."""
    runtime = Runtime.of(cfg) if runtime is None else runtime
    ident = identify(cfg, runtime)  # named, tagged, its start checkpoint's model merged in: once a process
    settings = _validated(cfg, ident, runtime)  # model, optim and eval, typed: validated once
    cfg = ident.config
    check_machine(cfg)
    keep_last_n = OmegaConf.select(cfg, "callbacks.step_checkpoints.keep_last_n", default=0)
    tokens = (cfg.trainer, cfg.data.max_tokens, settings.optim.tokens_per_update)
    start = ident.start
    return RunSpec(run_dir=ident.folder, name=ident.name, group=ident.group, tags=ident.tags, labels=ident.labels,
                   choices=ident.choices, identity=ident.identity, identity_hash=ident.hash,
                   start=start.given if start else None, start_path=start.path if start else None,
                   finetune=bool(cfg.get("finetune")), resume=bool(cfg.get("resume")) and not cfg.get("finetune"),
                   retrain=bool(cfg.get("retrain")), seed=int(cfg.seed), project=str(cfg.project), model=settings.model,
                   optim=settings.optim, eval=settings.eval, final=FinalPasses.of(settings.eval, keep_last_n),
                   compile=cfg.model.get("compile", False), max_steps=int(cfg.trainer.max_steps),
                   max_time=cfg.trainer.get("max_time"), trainer_overrides=trainer_overrides(*tokens),
                   budget_notes=budget_notes(*tokens, settings.model.max_positions),
                   config=identity.plain(cfg),
                   data=cfg.data, trainer=cfg.trainer, callbacks=cfg.get("callbacks"), loggers=cfg.get("logger"))


def _validated(cfg: DictConfig, ident: RunIdentity, runtime: Runtime) -> Validated:
    """Validate once, the config as it runs (the start checkpoint's model merged in); its typed settings.
    A start checkpoint that cannot be read is named after the command line's own errors, which come
    first, as they did when the command validated before reading the checkpoint."""
    start = ident.start
    if start is not None and start.error is not None:
        validated(cfg, runtime.choices)
        raise start.error
    try:
        return validated(ident.config, runtime.choices)  # fails before any data is read, naming the key
    except ConfigError as e:
        raise _not_combined(cfg, ident, runtime, e) from None


def _not_combined(cfg: DictConfig, ident: RunIdentity, runtime: Runtime, err: ConfigError) -> ConfigError:
    """A model setting typed on the command line that does not combine with the start checkpoint's
    model: the error names the checkpoint and the typed keys (the values it lists are both's). An error
    the command line makes on its own is reported as its own (checked only once the config as it runs
    failed: a run that validates is validated once)."""
    if ident.start is None or not ident.start.model:
        return err
    try:
        validated(cfg, runtime.choices)
    except ConfigError as own:
        return own
    model_keys = ("model", "norm", "regularizer", "init", "data.vocab_size")
    typed = [o.lstrip("+~") for o in runtime.overrides
             if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] in model_keys
             or o.lstrip("+~").startswith("data.vocab_size=")]
    key = "finetune" if cfg.get("finetune") else "resume"
    return ConfigError(f"{key}={ident.start.given}", f"the checkpoint's model and the command line's "
                                                     f"{' '.join(typed) or 'settings'} do not combine: {err}")
