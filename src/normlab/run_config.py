"""The composed Hydra config of a run, validated before any data is read: the model groups into a
ModelConfig (normlab/config.py's dataclasses), then optim, eval, trainer and the machine, each error
naming its key (`optim.lr`, `trainer.precision`, ...) and the allowed values.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

from normlab.config import (ConfigError, ModelConfig, NormConfig, RegularizerConfig, check, check_bool, check_choice,
                            check_number, check_positive, is_num)
from normlab.regularizers.rate_schedules import DEFAULT_SCHEDULE
from normlab.lr_schedule import DECAYING, SCHEDULES as LR_SCHEDULES
from normlab.settings import EvalSpec, OptimSpec


# Keys of the `model` group that say how to run the model, not what it is: not in ModelConfig,
# so checkpoints and rebuilt models do not depend on them (read by train.py).
RUNTIME_MODEL_KEYS = ("compile",)


def model_config_from_hydra(cfg: Any, vocab_size: int | None = None, special: Mapping | None = None) -> ModelConfig:
    """ModelConfig from the Hydra tree: the groups model, norm and regularizer hold exactly the
    fields of ModelConfig, NormConfig and RegularizerConfig; init.name is ModelConfig.init."""
    from omegaconf import OmegaConf

    def plain(node: Any) -> dict:
        return dict(OmegaConf.to_container(node, resolve=True)) if node is not None else {}

    model = {k: v for k, v in plain(cfg.model).items() if k not in RUNTIME_MODEL_KEYS}
    norm, reg = plain(cfg.norm), plain(cfg.get("regularizer"))
    for group, node, cls, own in (("model", model, ModelConfig, ("norm", "regularizer", "init")),
                                  ("norm", norm, NormConfig, ()), ("regularizer", reg, RegularizerConfig, ())):
        allowed = sorted({f.name for f in dataclasses.fields(cls)} - set(own))
        unknown = sorted(set(node) - set(allowed))
        shown = sorted(allowed + list(RUNTIME_MODEL_KEYS)) if group == "model" else allowed
        check(not unknown, f"{group}.{unknown[0] if unknown else ''}", f"not a {group} option", shown)
    if vocab_size is not None:
        model["vocab_size"] = vocab_size
    model.update(special or {})
    init = cfg.init.name if cfg.get("init") is not None else "xavier"
    return ModelConfig(**model, init=init, norm=NormConfig(**norm), regularizer=RegularizerConfig(**reg))


MONITORS = ("valid/bleu", "valid/chrf", "valid/loss", "valid/nll", "valid/ppl", "step")  # what validation logs
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "tpu", "auto")
PRECISIONS = ("32-true", "32", 32, "16-mixed", "16", 16, "bf16-mixed", "bf16", "16-true", "bf16-true",
              "64-true", "64", 64, "transformer-engine", "transformer-engine-float16")


class Validated(NamedTuple):
    """The typed settings a validated config holds (run_spec.resolve keeps them: validated once)."""
    model: ModelConfig
    optim: OptimSpec
    eval: EvalSpec


def validate_run_config(cfg: Any, choices: Mapping | None = None) -> ModelConfig:
    """Every check that can run before data is read; raises ConfigError naming the key. `choices`:
    Hydra's (run_identity.Runtime), to name a group option given where a run's key belongs."""
    return validated(cfg, choices).model


def validated(cfg: Any, choices: Mapping | None = None) -> Validated:
    """validate_run_config, with the model, optimizer and evaluation settings it built on the way."""
    missing = _missing_keys(cfg)
    check(not missing, missing[0] if missing else "",
          f"no value given (the config says ???): set it with {missing[0] if missing else ''}=..."
          + (f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else ""))
    _refuse_study(cfg, choices or {})
    check_number("seed", cfg.seed, "an integer in [0, 2**32 - 1]", lambda v: 0 <= v <= 2**32 - 1, integer=True)
    check_bool("retrain", cfg.get("retrain", False))  # `retrain=no` must not read as true
    if cfg.data.get("num_workers") is not None:
        check_number("data.num_workers", cfg.data.num_workers, "an integer >= 0", lambda v: v >= 0, integer=True)
    if cfg.data.get("spm_model_type") is not None:
        check_choice("data.spm_model_type", cfg.data.spm_model_type, ("bpe", "unigram", "char", "word"))
    vocab = cfg.data.get("vocab_size")  # null for data=preprocessed: the folder's tokenizer decides
    if vocab is not None:
        check_positive("data.vocab_size", vocab)  # before the model, which gets its vocab_size from it
    model_cfg = model_config_from_hydra(cfg, vocab_size=vocab)
    compile = cfg.model.get("compile", False)
    if not isinstance(compile, bool):
        import torch

        check_choice("model.compile", compile, (True, False, *torch.compiler.list_backends(exclude_tags=())))
    for key in ("max_tokens", "eval_max_tokens"):  # a batch must hold the longest pair data keeps / cuts to
        if cfg.data.get(key) is not None:
            check_positive(f"data.{key}", cfg.data[key])
            check(cfg.data[key] >= model_cfg.max_positions, f"data.{key}", f"{cfg.data[key]} cannot hold a pair "
                  f"of model.max_positions={model_cfg.max_positions} tokens",
                  f"an integer >= {model_cfg.max_positions}")
    init = cfg.get("init") or {}
    if init.get("admin") is not None:
        from normlab.init.modes import MODES

        check_choice("init.admin.mode", init.admin.get("mode", "profile"), MODES)
        check_positive("init.admin.batches", init.admin.get("batches", 1))
    reg = model_cfg.regularizer
    for key in ("encoder_layerdrop", "decoder_layerdrop", "drophead"):  # p = 1 is a limit case, not a run
        check(getattr(reg, key) < 1.0, f"regularizer.{key}", f"{getattr(reg, key)!r} drops every "
              f"{'head' if key == 'drophead' else 'layer'} at every step: nothing would train",
              "a probability in [0, 1)")
    optim, ev = optim_and_eval(cfg)
    _validate_trainer(cfg.trainer)
    check(optim.schedule not in DECAYING or cfg.trainer.max_steps > optim.warmup, f"optim.schedule={optim.schedule}",
          f"it decays to 0 at trainer.max_steps, and trainer.max_steps={cfg.trainer.max_steps} is not after "
          f"optim.warmup={optim.warmup}", f"trainer.max_steps above optim.warmup, or optim.schedule="
          f"{'|'.join(s for s in LR_SCHEDULES if s not in DECAYING)}")
    callbacks = cfg.get("callbacks") or {}
    _validate_drophead_schedule(callbacks.get("drophead_schedule"), reg.drophead, cfg.trainer.max_steps)
    for key in ("keep_last_n", "every_n_steps"):
        if callbacks.get("step_checkpoints") is not None:
            check_number(f"callbacks.step_checkpoints.{key}", callbacks.step_checkpoints.get(key) or 0,
                         "an integer >= 0",
                         lambda v: v >= 0, integer=True)
    if callbacks.get("checkpoint") is not None:
        check_choice("callbacks.checkpoint.mode", callbacks.checkpoint.get("mode", "max"), ("max", "min"))
        check_choice("callbacks.checkpoint.monitor", callbacks.checkpoint.get("monitor", "valid/bleu"), MONITORS)
    for key, node in (cfg.get("logger") or {}).items():
        check(node is None or (hasattr(node, "keys") and "_target_" in node), f"logger.{key}",
              "not a logger (a node with a _target_ class, as in conf/logger/*.yaml)", "wandb, csv, tensorboard")
    return Validated(model_cfg, optim, ev)


def _validate_drophead_schedule(node: Any, p: float, max_steps: int) -> None:
    """The V-shaped DropHead schedule rises to p at the run's last step (Zhou et al. 2020;
    regularizers/rate_schedules.py): without trainer.max_steps or the callback's own `total` it has
    none (was: a ValueError traceback at the first training batch, after the corpus was read)."""
    if node is None or not p or (node.get("schedule") or DEFAULT_SCHEDULE) != "v_shape" or node.get("total") is not None:
        return
    check(max_steps != -1, "callbacks.drophead_schedule.schedule=v_shape",
          "its rate rises to regularizer.drophead at the last step, and trainer.max_steps=-1 sets none",
          "trainer.max_steps=N, callbacks.drophead_schedule.total=N, or callbacks.drophead_schedule.schedule=constant")


def _refuse_study(cfg: Any, choices: Mapping) -> None:
    """conf/study/ holds studies, which normlab-study runs: `+study=NAME` would add the study's
    definition to one run's config, run nothing of the study and rename the run (a new key)."""
    if cfg.get("study") is None:
        return
    name = choices.get("study")
    check(False, f"study={name or '...'}", "a study is run with normlab-study, not as a key of one run "
          f"(normlab-study {name or 'NAME'}; normlab-study --list names them)")


def _missing_keys(node: Any, prefix: str = "") -> list[str]:
    """The ??? keys, in the order the config lists them (Hydra's own node, set at run time, aside)."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(node, DictConfig):
        return []
    tree = OmegaConf.to_container(node, resolve=False)  # read once, unresolved: ??? as "???", an interpolation as text
    tree.pop("hydra", None)

    def walk(tree: dict, prefix: str) -> list[str]:
        out = []
        for key, value in tree.items():
            if value == "???":
                out.append(f"{prefix}{key}")
            elif isinstance(value, dict):  # a node (a list's items are not read)
                out += walk(value, f"{prefix}{key}.")
        return out

    return walk(tree, prefix)


def optim_and_eval(cfg: Any) -> tuple[OptimSpec, EvalSpec]:
    """The config's `optim` and `eval` as their typed settings (normlab/settings.py), validated."""
    from omegaconf import OmegaConf

    plain = lambda node: OmegaConf.to_container(node, resolve=True) if node is not None else {}  # noqa: E731
    return OptimSpec.of(plain(cfg.get("optim"))).validate(), EvalSpec.of(plain(cfg.get("eval"))).validate()


def check_machine(cfg: Any) -> None:
    """What this machine must have for the run (not part of validating a config, which a CPU machine
    does for GPU presets too): a CUDA GPU for accelerator gpu / cuda."""
    accel = cfg.trainer.get("accelerator", "auto")
    if accel in ("gpu", "cuda"):
        import torch

        check(torch.cuda.is_available(), "trainer.accelerator", f"{accel!r}: this machine has no CUDA GPU",
              "cpu, or trainer=gpu on a GPU machine")


def _is_duration(value: Any) -> bool:
    """Lightning's max_time string: DD:HH:MM:SS."""
    parts = str(value).split(":") if isinstance(value, str) else []
    return len(parts) == 4 and all(p.isdigit() for p in parts)


def _validate_trainer(t: Any) -> None:
    check_number("trainer.max_steps", t.max_steps, "an integer > 0, or -1 for no limit", lambda v: v == -1 or v > 0,
                 integer=True)
    check_number("trainer.max_epochs", t.get("max_epochs"), "an integer > 0, -1 or null", lambda v: v == -1 or v > 0,
                 integer=True, null=True)
    check_number("trainer.val_check_interval", t.get("val_check_interval"),
                 "an integer number of steps > 0, a fraction of an epoch in (0, 1], or null",
                 lambda v: v > 0 if isinstance(v, int) else 0 < v <= 1, null=True)
    check_number("trainer.log_every_n_steps", t.get("log_every_n_steps", 50), "an integer > 0", lambda v: v > 0,
                 integer=True)
    check_number("trainer.accumulate_grad_batches", t.get("accumulate_grad_batches", 1), "an integer > 0",
                 lambda v: v > 0, integer=True)
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "overfit_batches"):
        if t.get(key) is not None:
            check_number(f"trainer.{key}", t[key], "an integer number of batches >= 0 or a fraction in [0, 1]",
                         lambda v: v >= 0 if isinstance(v, int) else 0 <= v <= 1)
    limit = t.get("limit_train_batches")
    check(limit is None or limit != 0, "trainer.limit_train_batches", "0 trains no batch",
          "an integer > 0 or a fraction in (0, 1]")
    check_number("trainer.num_nodes", t.get("num_nodes", 1), "an integer > 0", lambda v: v > 0, integer=True)
    devices = t.get("devices", 1)
    check(devices in ("auto", -1, "-1") or (is_num(devices, integer=True) and devices > 0)
          or (hasattr(devices, "__len__") and not isinstance(devices, str) and len(devices) > 0),
          "trainer.devices", f"{devices!r} is not valid", "an integer > 0, -1, auto, or a list of device ids")
    accel = t.get("accelerator", "auto")
    if isinstance(accel, str):
        check_choice("trainer.accelerator", accel, ACCELERATORS)
    max_time = t.get("max_time")
    check(max_time is None or hasattr(max_time, "keys") or _is_duration(max_time), "trainer.max_time",
          f"{max_time!r} is not valid", "null, DD:HH:MM:SS (e.g. 00:12:00:00), or {hours: 12}")
    fdr = t.get("fast_dev_run", False)
    check(isinstance(fdr, bool) or (is_num(fdr, integer=True) and fdr >= 0), "trainer.fast_dev_run",
          f"{fdr!r} is not valid", "true, false or a number of batches >= 0")
    check_number("trainer.gradient_clip_val", t.get("gradient_clip_val"), "a number >= 0 or null", lambda v: v >= 0,
                 null=True)
    if t.get("precision") is not None:  # null: Lightning's default, or a precision plugin's
        check_choice("trainer.precision", t["precision"], PRECISIONS)
    import inspect

    from lightning import Trainer

    known = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    unknown = sorted(k for k in t if not str(k).startswith("_") and k not in known)
    check(not unknown, f"trainer.{unknown[0] if unknown else ''}", "not a lightning.Trainer argument",
          "see python -c 'import lightning; help(lightning.Trainer)'")
