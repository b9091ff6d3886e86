"""Plain dataclasses that describe a model, validated on construction.

The model package is built from `ModelConfig` alone, so a checkpoint stores
`asdict(ModelConfig)` and rebuilds the network without Hydra (nanoGPT's GPTConfig).
Validation errors name the Hydra key (`model.d_model`, `norm.type`, ...) and the
allowed values, so a bad override fails before any data is read. Each list of allowed values is
imported from the module that owns the choice (the norms from model/norms.py, placements from
model/residual.py, ...), never repeated here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from normlab.losses import CONVENTIONS as LABEL_SMOOTHING_CONVENTIONS
from normlab.lr_schedule import SCHEDULES as LR_SCHEDULES
from normlab.model.aggregation import AGGREGATION_STACKS, AGGREGATIONS
from normlab.model.initialization import INITS
from normlab.model.norms import NORMS
from normlab.model.residual import PLACEMENTS
from normlab.regularizers.layerdrop import RATES as LAYERDROP_RATES


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _choice(key: str, value: Any, allowed: tuple) -> None:
    _check(value in allowed, f"{key}={value!r} is not valid; allowed values: {', '.join(map(str, allowed))}")


def _prob(key: str, value: float) -> None:
    _check(isinstance(value, (int, float)) and 0.0 <= value <= 1.0,
           f"{key}={value!r} must be a probability in [0, 1]")


def _positive(key: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value > 0,
           f"{key}={value!r} must be a positive integer")


@dataclass
class NormConfig:
    type: str = "layernorm"  # model/norms.py: layernorm | scalenorm | rmsnorm | dyt | none
    placement: str = "post"  # model/residual.py: post | pre | deepnorm | subln | sandwich | rezero | resi_dual
    fixnorm: bool = False  # Nguyen & Salazar 2019: l2-normalised embeddings and a cosine output layer
    eps: float = 1e-5
    scale_init: float | None = None  # ScaleNorm g init; None -> sqrt(d) as in the paper
    dyt_alpha_init: float = 0.5  # DyT's α at init (Zhu et al. 2025's default)

    def validate(self) -> None:
        _choice("norm.type", self.type, tuple(NORMS))
        _choice("norm.placement", self.placement, PLACEMENTS)
        _check((self.type == "none") == (self.placement == "rezero"),
               f"norm.type={self.type} with norm.placement={self.placement}: ReZero (Bachlechner et al. 2020) "
               "is the only placement without a norm; use norm.type=none exactly with norm.placement=rezero")
        _check(self.dyt_alpha_init > 0, f"norm.dyt_alpha_init={self.dyt_alpha_init!r} must be > 0")
        _check(isinstance(self.fixnorm, bool), f"norm.fixnorm={self.fixnorm!r} must be true or false")
        _check(self.eps > 0, f"norm.eps={self.eps!r} must be > 0")
        _check(self.scale_init is None or self.scale_init > 0,
               f"norm.scale_init={self.scale_init!r} must be > 0 or null")


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
    # How a stack combines its layers (model/aggregation.py): none | dlcl (Wang et al. 2019), on
    # the encoder, the decoder or both.
    layer_aggregation: str = "none"
    layer_aggregation_stacks: str = "both"
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
        _check(self.d_model % self.encoder_heads == 0,
               f"model.d_model={self.d_model} is not divisible by model.encoder_heads={self.encoder_heads}")
        _check(self.decoder_d_model % self.decoder_heads == 0,
               f"model.decoder_d_model={self.decoder_d_model} is not divisible by "
               f"model.decoder_heads={self.decoder_heads}")
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            _prob(f"model.{key}", getattr(self, key))
        _check(not self.share_embeddings or self.d_model == self.decoder_d_model,
               "model.share_embeddings=true needs model.d_model == model.decoder_d_model")
        _choice("init.name", self.init, INITS)
        _check(self.init != "admin" or self.norm.placement == "post",
               f"init=admin with norm.placement={self.norm.placement}: Admin is defined for post-norm models "
               "(Liu et al. 2020); set norm.placement=post")
        _choice("model.layer_aggregation", self.layer_aggregation, AGGREGATIONS)
        _choice("model.layer_aggregation_stacks", self.layer_aggregation_stacks, AGGREGATION_STACKS)
        self.norm.validate()
        self.regularizer.validate()
        if self.layer_aggregation == "dlcl":
            self._check_dlcl()

    def _check_dlcl(self) -> None:
        key = "model.layer_aggregation=dlcl"
        _check(self.init != "admin", f"init=admin with {key}: Admin's ω profile assumes each sub-layer reads "
                                     "the previous one's output (Liu et al. 2020); DLCL feeds it a learned mix")
        _check(self.norm.placement != "resi_dual", f"norm.placement=resi_dual with {key}: ResiDual's dual "
                                                   "stream is its own cross-layer connection; choose one")
        for stack in ("encoder", "decoder"):
            p = getattr(self.regularizer, f"{stack}_layerdrop")
            _check(p == 0 or self.layer_aggregation_stacks not in (stack, "both"),
                   f"regularizer.{stack}_layerdrop={p} with {key} on the {stack}: a dropped layer's slot in "
                   "DLCL's weighted history is undefined; set the rate to 0 or model.layer_aggregation_stacks")

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
        _check(not unknown, f"{group}.{unknown[0] if unknown else ''} is not a {group} option; "
                            f"allowed: {', '.join(shown)}")
    if vocab_size is not None:
        model["vocab_size"] = vocab_size
    model.update(special or {})
    init = cfg.init.name if cfg.get("init") is not None else "xavier"
    return ModelConfig(**model, init=init, norm=NormConfig(**norm), regularizer=RegularizerConfig(**reg))


def validate_run_config(cfg: Any) -> ModelConfig:
    """Every check that can run before data is read; raises ConfigError naming the key."""
    vocab = cfg.data.get("vocab_size")  # null for data=preprocessed: the folder's tokenizer decides
    model_cfg = model_config_from_hydra(cfg, vocab_size=None if vocab is None else int(vocab))
    compile = cfg.model.get("compile", False)
    if not isinstance(compile, bool):
        import torch

        _choice("model.compile", compile, (True, False, *torch.compiler.list_backends(exclude_tags=())))
    o = cfg.optim
    _check(o.lr is None or o.lr > 0, f"optim.lr={o.lr!r} must be > 0 (or null for the paper's scale)")
    _check(o.get("scale", 1.0) > 0, f"optim.scale={o.get('scale')!r} must be > 0")
    _check(isinstance(o.warmup, int) and o.warmup >= 0, f"optim.warmup={o.warmup!r} must be an integer >= 0")
    _check(0.0 <= o.label_smoothing < 1.0, f"optim.label_smoothing={o.label_smoothing!r} must be in [0, 1)")
    _choice("optim.label_smoothing_convention", o.get("label_smoothing_convention", "uniform"),
            LABEL_SMOOTHING_CONVENTIONS)
    _choice("optim.schedule", o.get("schedule", "inverse_sqrt"), LR_SCHEDULES)
    _check(o.clip_norm >= 0, f"optim.clip_norm={o.clip_norm!r} must be >= 0")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), f"optim.betas={list(o.betas)!r} must be two values in [0, 1)")
    _positive("data.max_tokens", cfg.data.max_tokens)
    if vocab is not None:
        _positive("data.vocab_size", vocab)
    for key in ("decoder", "test_decoder"):
        d = cfg.eval.get(key)
        if d is None:
            continue
        _positive(f"eval.{key}.beam", d.beam)
        _check(d.max_len_a >= 0 and d.max_len_b >= 0, f"eval.{key}.max_len_a and max_len_b must be >= 0")
    _check(cfg.trainer.max_steps == -1 or cfg.trainer.max_steps > 0,
           f"trainer.max_steps={cfg.trainer.max_steps!r} must be > 0 (or -1 for no limit)")
    _choice("logger.name", cfg.logger.name, ("wandb", "csv", "none"))
    return model_cfg
