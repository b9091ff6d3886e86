"""Plain dataclasses that describe a model, validated on construction.

The model package is built from `ModelConfig` alone, so a checkpoint stores
`asdict(ModelConfig)` and rebuilds the network without Hydra (nanoGPT's GPTConfig).
Validation errors name the Hydra key (`model.d_model`, `norm.type`, ...) and the
allowed values, so a bad override fails before any data is read. Each list of allowed values is
imported from the module that owns the choice (the norms from model/norms.py, placements from
model/schemes/, ...), never repeated here; so are the combinations a residual scheme refuses.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from normlab.errors import UserError
from normlab.losses import CONVENTIONS as LABEL_SMOOTHING_CONVENTIONS
from normlab.model.attention import QK_NORMS
from normlab.model.hyper import MIXINGS as RESIDUAL_MIXINGS, RESIDUALS, STREAMS as RESIDUAL_STREAMS
from normlab.model.hyper import refusal as residual_refusal
from normlab.lr_schedule import SCHEDULES as LR_SCHEDULES
from normlab.model.aggregation import AGGREGATION_STACKS, AGGREGATIONS
from normlab.model.initialization import INITS
from normlab.model.norms import NORMS
from normlab.model.schemes import MIX_RATIO, PLACEMENTS, get_scheme
from normlab.regularizers.layerdrop import RATES as LAYERDROP_RATES


class ConfigError(UserError, ValueError):
    """An invalid configuration value: `<key>: <what> (allowed: ...)`."""


def _check(cond: bool, key: str, what: str, allowed: Any = None) -> None:
    if not cond:
        raise ConfigError(key, what, allowed)


def _is_num(value: Any, integer: bool = False) -> bool:
    return isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)


def _value(key: str, value: Any, allowed: str, ok=lambda v: True, integer: bool = False, null: bool = False) -> None:
    """A number (an int with integer=True; None with null=True) for which ok(value) holds."""
    if value is None and null:
        return
    _check(_is_num(value, integer) and ok(value), key, f"{value!r} is not valid", allowed)


def _refuse(refusal: tuple[str, str] | None) -> None:
    # A residual scheme's refusal of a combination (model/schemes/): (key, what).
    if refusal is not None:
        raise ConfigError(*refusal)


def _choice(key: str, value: Any, allowed: tuple) -> None:
    _check(value in allowed, key, f"{value!r} is not valid", allowed)


def _prob(key: str, value: float) -> None:
    _value(key, value, "a probability in [0, 1]", lambda v: 0.0 <= v <= 1.0)


def _positive(key: str, value: Any) -> None:
    _value(key, value, "an integer > 0", lambda v: v > 0, integer=True)


def _bool(key: str, value: Any) -> None:
    _check(isinstance(value, bool), key, f"{value!r} is not valid", "true, false")


@dataclass
class NormConfig:
    type: str = "layernorm"  # model/norms.py: layernorm | scalenorm | rmsnorm | dyt | derf | none
    placement: str = "post"  # model/schemes/: post | pre | deepnorm | subln | sandwich | rezero | resi_dual | ...
    fixnorm: bool = False  # Nguyen & Salazar 2019: l2-normalised embeddings and a cosine output layer
    eps: float = 1e-5
    scale_init: float | None = None  # ScaleNorm g init; None -> sqrt(d) as in the paper
    dyt_alpha_init: float = 0.5  # DyT's α at init (Zhu et al. 2025's default)
    mix_ratio: float = MIX_RATIO  # Mix-LN's α (Li et al. 2025): post-norm in the first ⌊αL⌋ layers

    def validate(self) -> None:
        _choice("norm.type", self.type, tuple(NORMS))
        _choice("norm.placement", self.placement, PLACEMENTS)
        _value("norm.mix_ratio", self.mix_ratio, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        _refuse(get_scheme(self.placement).norm_refusal(self))
        _value("norm.dyt_alpha_init", self.dyt_alpha_init, "a number > 0", lambda v: v > 0)
        _bool("norm.fixnorm", self.fixnorm)
        _value("norm.eps", self.eps, "a number > 0", lambda v: v > 0)
        _value("norm.scale_init", self.scale_init, "a number > 0, or null for sqrt(d_model)", lambda v: v > 0, null=True)


@dataclass
class RegularizerConfig:
    # LayerDrop (Fan et al. 2019): probability of skipping each layer during training.
    encoder_layerdrop: float = 0.0
    decoder_layerdrop: float = 0.0
    # Scheduled DropHead (Zhou et al. 2020): the schedule callback sets p at run time.
    drophead: float = 0.0
    drophead_encoder_self: bool = True
    drophead_decoder_self: bool = True
    drophead_cross: bool = True
    # uniform: every layer dropped with the stack's rate; learned: per-layer rates with mean held at
    # the stack's rate, learned in training for data-driven pruning (regularizers/layerdrop.py).
    layerdrop_rates: str = "uniform"

    def validate(self) -> None:
        for key in ("encoder_layerdrop", "decoder_layerdrop", "drophead"):
            _prob(f"regularizer.{key}", getattr(self, key))
        for key in ("drophead_encoder_self", "drophead_decoder_self", "drophead_cross"):
            _bool(f"regularizer.{key}", getattr(self, key))
        _choice("regularizer.layerdrop_rates", self.layerdrop_rates, LAYERDROP_RATES)


@dataclass
class ModelConfig:
    vocab_size: int = 8000
    d_model: int = 128  # encoder width; decoder_d_model defaults to it
    decoder_d_model: int | None = None
    encoder_layers: int = 3
    decoder_layers: int = 3
    encoder_heads: int = 4
    decoder_heads: int = 4
    encoder_ffn: int = 512
    decoder_ffn: int = 512
    dropout: float = 0.0  # sub-layer outputs and embeddings + positions (Vaswani et al. 2017, 5.4)
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    max_positions: int = 256
    learned_positions: bool = False
    share_embeddings: bool = True  # encoder and decoder share one embedding matrix
    tie_output_embeddings: bool = True  # output projection = decoder embedding (Press & Wolf 2017)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    init: str = "xavier"  # xavier | admin (admin adds a trainable omega to every residual)
    # How a stack combines its layers (model/aggregation.py): none | dlcl (Wang et al. 2019) | dwa
    # (DenseFormer, Pagliardini et al. 2024), on the encoder, the decoder or both.
    layer_aggregation: str = "none"
    layer_aggregation_stacks: str = "both"
    # QK-norm (model/attention.py) in every attention of both stacks: none | l2 (Henry et al. 2020,
    # logits g·q̂·k̂, g₀ = qk_norm_scale_init, null: log₂(L² − L) with L = max_positions) | rms (OLMo 2).
    qk_norm: str = "none"
    qk_norm_scale_init: float | None = None
    # Value residual (Zhou et al. 2024; model/attention.py): self-attention of layer n attends over
    # λ₁·V₁ + λ₂·V_n, V₁ the first layer's values of the same stack, λ learned (init 0.5).
    value_residual: bool = False
    # Hyper-connections (model/hyper.py): add (one residual stream) | hyper (Zhu et al. 2024) | mhc
    # (Xie et al. 2025, doubly-stochastic stream mixing); n streams, static or dynamic mixing.
    residual: str = "add"
    residual_streams: int = RESIDUAL_STREAMS
    residual_mixing: str = "static"
    norm: NormConfig = field(default_factory=NormConfig)
    regularizer: RegularizerConfig = field(default_factory=RegularizerConfig)

    def __post_init__(self) -> None:
        if isinstance(self.norm, Mapping):
            self.norm = NormConfig(**self.norm)
        if isinstance(self.regularizer, Mapping):
            self.regularizer = RegularizerConfig(**self.regularizer)
        if self.decoder_d_model is None:
            self.decoder_d_model = self.d_model
        self.validate()

    def validate(self) -> None:
        for key in ("vocab_size", "d_model", "decoder_d_model", "encoder_layers", "decoder_layers",
                    "encoder_heads", "decoder_heads", "encoder_ffn", "decoder_ffn", "max_positions"):
            _positive(f"model.{key}", getattr(self, key))
        _check(self.d_model % self.encoder_heads == 0, "model.d_model",
               f"{self.d_model} is not divisible by model.encoder_heads={self.encoder_heads}")
        _check(self.decoder_d_model % self.decoder_heads == 0, "model.decoder_d_model",
               f"{self.decoder_d_model} is not divisible by model.decoder_heads={self.decoder_heads}")
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            _prob(f"model.{key}", getattr(self, key))
        for key in ("learned_positions", "share_embeddings", "tie_output_embeddings", "value_residual"):
            _bool(f"model.{key}", getattr(self, key))
        _check(not self.share_embeddings or self.d_model == self.decoder_d_model, "model.share_embeddings",
               f"true needs model.d_model == model.decoder_d_model ({self.d_model} != {self.decoder_d_model})")
        _choice("init.name", self.init, INITS)
        _choice("norm.placement", self.norm.placement, PLACEMENTS)
        # every choice is checked before a combination of them, so a typo is named as itself
        _choice("model.layer_aggregation", self.layer_aggregation, AGGREGATIONS)
        _choice("model.layer_aggregation_stacks", self.layer_aggregation_stacks, AGGREGATION_STACKS)
        _choice("model.qk_norm", self.qk_norm, QK_NORMS)
        _value("model.qk_norm_scale_init", self.qk_norm_scale_init, "a number > 0, or null for log2(L² - L), "
               "L = model.max_positions", lambda v: v > 0, null=True)
        _choice("model.residual", self.residual, RESIDUALS)
        _positive("model.residual_streams", self.residual_streams)
        _choice("model.residual_mixing", self.residual_mixing, RESIDUAL_MIXINGS)
        # a value that does nothing would still rename the run (it is identity): refused, as norm.mix_ratio
        _check(self.qk_norm_scale_init is None or self.qk_norm == "l2", "model.qk_norm_scale_init",
               f"{self.qk_norm_scale_init} with model.qk_norm={self.qk_norm}: only l2 QK-norm has a learned scale g "
               "(Henry et al. 2020); set model.qk_norm=l2 or leave the scale null")
        self.norm.validate()
        _refuse(residual_refusal(self))  # placements other than pre-norm's, DLCL; keys unused by add
        self.regularizer.validate()
        _refuse(get_scheme(self.norm.placement).model_refusal(self))  # init=admin, DLCL, DWA
        # Under learned LayerDrop rates a gated-off layer still runs (its output is discarded,
        # regularizers/layerdrop.py), so a gated-off first layer would still set V₁ for the layers
        # after it: the model would differ from the one pruning leaves (the first kept layer's V₁).
        layerdrop = self.regularizer.encoder_layerdrop or self.regularizer.decoder_layerdrop
        _check(not (self.value_residual and layerdrop and self.regularizer.layerdrop_rates == "learned"),
               "model.value_residual", "true with regularizer.layerdrop_rates=learned: a gated-off first layer "
               "would still give the value residual its V₁, which the pruned model (data-driven pruning) does "
               "not have; use regularizer.layerdrop_rates=uniform")
        if self.layer_aggregation != "none":
            self._check_aggregation()

    def _check_aggregation(self) -> None:
        # DLCL and DWA (model/aggregation.py); Admin's profile runs at init, where DWA is the identity,
        # so each sub-layer reads the previous one's output as Admin assumes: only DLCL refuses it.
        agg = self.layer_aggregation
        _check(self.init != "admin" or agg != "dlcl", "model.layer_aggregation",
               "dlcl with init=admin: Admin's ω profile assumes each sub-layer reads "
               "the previous one's output (Liu et al. 2020); DLCL feeds it a learned mix")
        for stack in ("encoder", "decoder"):
            p = getattr(self.regularizer, f"{stack}_layerdrop")
            _check(p == 0 or self.layer_aggregation_stacks not in (stack, "both"), f"regularizer.{stack}_layerdrop",
                   f"{p} with model.layer_aggregation={agg} on the {stack}: a dropped layer's slot in {agg.upper()}'s "
                   "weighted history is undefined; set the rate to 0 or model.layer_aggregation_stacks")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


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
        _check(not unknown, f"{group}.{unknown[0] if unknown else ''}", f"not a {group} option", shown)
    if vocab_size is not None:
        model["vocab_size"] = vocab_size
    model.update(special or {})
    init = cfg.init.name if cfg.get("init") is not None else "xavier"
    return ModelConfig(**model, init=init, norm=NormConfig(**norm), regularizer=RegularizerConfig(**reg))


DECODER_KEYS = ("beam", "lenpen", "max_len_a", "max_len_b", "min_len")
MONITORS = ("valid/bleu", "valid/chrf", "valid/loss", "valid/nll", "valid/ppl", "step")  # what validation logs
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "tpu", "auto")
PRECISIONS = ("32-true", "32", 32, "16-mixed", "16", 16, "bf16-mixed", "bf16", "16-true", "bf16-true",
              "64-true", "64", 64, "transformer-engine", "transformer-engine-float16")


def validate_run_config(cfg: Any) -> ModelConfig:
    """Every check that can run before data is read; raises ConfigError naming the key."""
    missing = _missing_keys(cfg)
    _check(not missing, missing[0] if missing else "",
           f"no value given (the config says ???): set it with {missing[0] if missing else ''}=..."
           + (f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else ""))
    _value("seed", cfg.seed, "an integer in [0, 2**32 - 1]", lambda v: 0 <= v <= 2**32 - 1, integer=True)
    _bool("retrain", cfg.get("retrain", False))  # `retrain=no` must not read as true
    if cfg.data.get("num_workers") is not None:
        _value("data.num_workers", cfg.data.num_workers, "an integer >= 0", lambda v: v >= 0, integer=True)
    if cfg.data.get("spm_model_type") is not None:
        _choice("data.spm_model_type", cfg.data.spm_model_type, ("bpe", "unigram", "char", "word"))
    vocab = cfg.data.get("vocab_size")  # null for data=preprocessed: the folder's tokenizer decides
    if vocab is not None:
        _positive("data.vocab_size", vocab)  # before the model, which gets its vocab_size from it
    model_cfg = model_config_from_hydra(cfg, vocab_size=vocab)
    compile = cfg.model.get("compile", False)
    if not isinstance(compile, bool):
        import torch

        _choice("model.compile", compile, (True, False, *torch.compiler.list_backends(exclude_tags=())))
    for key in ("max_tokens", "eval_max_tokens"):  # a batch must hold the longest pair data keeps / cuts to
        if cfg.data.get(key) is not None:
            _positive(f"data.{key}", cfg.data[key])
            _check(cfg.data[key] >= model_cfg.max_positions, f"data.{key}", f"{cfg.data[key]} cannot hold a pair "
                   f"of model.max_positions={model_cfg.max_positions} tokens", f"an integer >= {model_cfg.max_positions}")
    init = cfg.get("init") or {}
    if init.get("admin") is not None:
        from normlab.init.modes import MODES

        _choice("init.admin.mode", init.admin.get("mode", "profile"), MODES)
        _positive("init.admin.batches", init.admin.get("batches", 1))
    reg = model_cfg.regularizer
    for key in ("encoder_layerdrop", "decoder_layerdrop", "drophead"):  # p = 1 is a limit case, not a run
        _check(getattr(reg, key) < 1.0, f"regularizer.{key}", f"{getattr(reg, key)!r} drops every "
               f"{'head' if key == 'drophead' else 'layer'} at every step: nothing would train",
               "a probability in [0, 1)")
    _validate_optim(cfg.optim)
    _validate_eval(cfg.eval)
    _validate_trainer(cfg.trainer)
    callbacks = cfg.get("callbacks") or {}
    for key in ("keep_last_n", "every_n_steps"):
        if callbacks.get("step_checkpoints") is not None:
            _value(f"callbacks.step_checkpoints.{key}", callbacks.step_checkpoints.get(key) or 0, "an integer >= 0",
                   lambda v: v >= 0, integer=True)
    if callbacks.get("checkpoint") is not None:
        _choice("callbacks.checkpoint.mode", callbacks.checkpoint.get("mode", "max"), ("max", "min"))
        _choice("callbacks.checkpoint.monitor", callbacks.checkpoint.get("monitor", "valid/bleu"), MONITORS)
    for key, node in (cfg.get("logger") or {}).items():
        _check(node is None or (hasattr(node, "keys") and "_target_" in node), f"logger.{key}",
               "not a logger (a node with a _target_ class, as in conf/logger/*.yaml)", "wandb, csv, tensorboard")
    return model_cfg


def _missing_keys(node: Any, prefix: str = "") -> list[str]:
    """The ??? keys, in the order the config lists them (Hydra's own node, set at run time, aside)."""
    from omegaconf import DictConfig, OmegaConf

    out = []
    for key in node.keys() if isinstance(node, DictConfig) else []:
        if not prefix and key == "hydra":
            continue
        full = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            out.append(full)
        elif isinstance(node._get_node(key), DictConfig):
            out += _missing_keys(node[key], f"{full}.")
    return out


def _validate_optim(o: Any) -> None:
    _value("optim.lr", o.lr, "a number > 0, or null for the paper's scale", lambda v: v > 0, null=True)
    _value("optim.scale", o.get("scale", 1.0), "a number > 0", lambda v: v > 0)
    _value("optim.warmup", o.warmup, "an integer >= 0", lambda v: v >= 0, integer=True)
    _value("optim.label_smoothing", o.label_smoothing, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0)
    _choice("optim.label_smoothing_convention", o.get("label_smoothing_convention", "uniform"),
            LABEL_SMOOTHING_CONVENTIONS)
    _choice("optim.schedule", o.get("schedule", "inverse_sqrt"), LR_SCHEDULES)
    _value("optim.clip_norm", o.clip_norm, "a number >= 0 (0: no clipping)", lambda v: v >= 0)
    _value("optim.eps", o.eps, "a number > 0", lambda v: v > 0)
    _value("optim.weight_decay", o.get("weight_decay", 0.0), "a number >= 0", lambda v: v >= 0)
    betas = list(o.betas) if hasattr(o.betas, "__len__") and not isinstance(o.betas, str) else [o.betas]
    _check(len(betas) == 2 and all(_is_num(b) and 0 <= b < 1 for b in betas), "optim.betas",
           f"{o.betas!r} is not valid", "two numbers in [0, 1), e.g. [0.9,0.98]")


def _validate_eval(ev: Any) -> None:
    for key in ("valid_bleu", "test", "test_greedy", "test_average"):
        if key in ev:
            _bool(f"eval.{key}", ev[key])
    for name in ("decoder", "test_decoder"):
        d = ev.get(name)
        if d is None:
            continue
        unknown = sorted(set(d) - set(DECODER_KEYS))
        _check(not unknown, f"eval.{name}.{unknown[0] if unknown else ''}", "not a decoder option", DECODER_KEYS)
        _positive(f"eval.{name}.beam", d.beam)
        _value(f"eval.{name}.lenpen", d.get("lenpen", 0.6), "a number (GNMT alpha; 0: none)")
        _value(f"eval.{name}.max_len_a", d.get("max_len_a", 1.0), "a number >= 0", lambda v: v >= 0)
        for key in ("max_len_b", "min_len"):
            _value(f"eval.{name}.{key}", d.get(key, 0), "an integer >= 0", lambda v: v >= 0, integer=True)


def check_machine(cfg: Any) -> None:
    """What this machine must have for the run (not part of validating a config, which a CPU machine
    does for GPU presets too): a CUDA GPU for accelerator gpu / cuda."""
    accel = cfg.trainer.get("accelerator", "auto")
    if accel in ("gpu", "cuda"):
        import torch

        _check(torch.cuda.is_available(), "trainer.accelerator", f"{accel!r}: this machine has no CUDA GPU",
               "cpu, or trainer=gpu on a GPU machine")


def _is_duration(value: Any) -> bool:
    """Lightning's max_time string: DD:HH:MM:SS."""
    parts = str(value).split(":") if isinstance(value, str) else []
    return len(parts) == 4 and all(p.isdigit() for p in parts)


def _validate_trainer(t: Any) -> None:
    _value("trainer.max_steps", t.max_steps, "an integer > 0, or -1 for no limit", lambda v: v == -1 or v > 0,
           integer=True)
    _value("trainer.max_epochs", t.get("max_epochs"), "an integer > 0, -1 or null", lambda v: v == -1 or v > 0,
           integer=True, null=True)
    _value("trainer.val_check_interval", t.get("val_check_interval"),
           "an integer number of steps > 0, a fraction of an epoch in (0, 1], or null",
           lambda v: v > 0 if isinstance(v, int) else 0 < v <= 1, null=True)
    _value("trainer.log_every_n_steps", t.get("log_every_n_steps", 50), "an integer > 0", lambda v: v > 0,
           integer=True)
    _value("trainer.accumulate_grad_batches", t.get("accumulate_grad_batches", 1), "an integer > 0",
           lambda v: v > 0, integer=True)
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "overfit_batches"):
        if t.get(key) is not None:
            _value(f"trainer.{key}", t[key], "an integer number of batches >= 0 or a fraction in [0, 1]",
                   lambda v: v >= 0 if isinstance(v, int) else 0 <= v <= 1)
    limit = t.get("limit_train_batches")
    _check(limit is None or limit != 0, "trainer.limit_train_batches", "0 trains no batch",
           "an integer > 0 or a fraction in (0, 1]")
    _value("trainer.num_nodes", t.get("num_nodes", 1), "an integer > 0", lambda v: v > 0, integer=True)
    devices = t.get("devices", 1)
    _check(devices in ("auto", -1, "-1") or (_is_num(devices, integer=True) and devices > 0)
           or (hasattr(devices, "__len__") and not isinstance(devices, str) and len(devices) > 0),
           "trainer.devices", f"{devices!r} is not valid", "an integer > 0, -1, auto, or a list of device ids")
    accel = t.get("accelerator", "auto")
    if isinstance(accel, str):
        _choice("trainer.accelerator", accel, ACCELERATORS)
    max_time = t.get("max_time")
    _check(max_time is None or hasattr(max_time, "keys") or _is_duration(max_time), "trainer.max_time",
           f"{max_time!r} is not valid", "null, DD:HH:MM:SS (e.g. 00:12:00:00), or {hours: 12}")
    fdr = t.get("fast_dev_run", False)
    _check(isinstance(fdr, bool) or (_is_num(fdr, integer=True) and fdr >= 0), "trainer.fast_dev_run",
           f"{fdr!r} is not valid", "true, false or a number of batches >= 0")
    _value("trainer.gradient_clip_val", t.get("gradient_clip_val"), "a number >= 0 or null", lambda v: v >= 0,
           null=True)
    if t.get("precision") is not None:  # null: Lightning's default, or a precision plugin's
        _choice("trainer.precision", t["precision"], PRECISIONS)
    import inspect

    from lightning import Trainer

    known = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    unknown = sorted(k for k in t if not str(k).startswith("_") and k not in known)
    _check(not unknown, f"trainer.{unknown[0] if unknown else ''}", "not a lightning.Trainer argument",
           "see python -c 'import lightning; help(lightning.Trainer)'")
