"""Plain dataclasses that describe a model, validated on construction.

The model package is built from `ModelConfig` alone, so a checkpoint stores
`asdict(ModelConfig)` and rebuilds the network without Hydra (nanoGPT's GPTConfig).
Validation errors name the Hydra key (`model.d_model`, `norm.type`, ...) and the
allowed values, so a bad override fails before any data is read. Each list of allowed values is
imported from the module that owns the choice (the norms from model/norms.py, placements from
model/schemes/, ...), never repeated here; so are the combinations a residual scheme refuses.
The composed Hydra config of a run (optim, eval, trainer, and the model groups into a ModelConfig)
is validated in normlab/run_config.py.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from normlab.errors import UserError
from normlab.model.qk_norms import QK_NORMS
from normlab.model.hyper import MIXINGS as RESIDUAL_MIXINGS, RESIDUALS, STREAMS as RESIDUAL_STREAMS
from normlab.model.hyper import refusal as residual_refusal
from normlab.model.aggregation import AGGREGATION_STACKS, AGGREGATIONS
from normlab.model.initialization import INITS
from normlab.model.norms import NORMS
from normlab.model.stability import ATTN_GATES
from normlab.model.schemes import MIX_RATIO, PLACEMENTS, get_scheme
from normlab.regularizers.layerdrop import RATES as LAYERDROP_RATES


class ConfigError(UserError, ValueError):
    """An invalid configuration value: `<key>: <what> (allowed: ...)`."""


def check(cond: bool, key: str, what: str, allowed: Any = None) -> None:
    if not cond:
        raise ConfigError(key, what, allowed)


def is_num(value: Any, integer: bool = False) -> bool:
    return isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)


def check_number(key: str, value: Any, allowed: str, ok=lambda v: True, integer: bool = False,
                 null: bool = False) -> None:
    """A number (an int with integer=True; None with null=True) for which ok(value) holds."""
    if value is None and null:
        return
    check(is_num(value, integer) and ok(value), key, f"{value!r} is not valid", allowed)


def _refuse(refusal: tuple[str, str] | None) -> None:
    # A residual scheme's refusal of a combination (model/schemes/): (key, what).
    if refusal is not None:
        raise ConfigError(*refusal)


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    check(value in allowed, key, f"{value!r} is not valid", allowed)


def _prob(key: str, value: float) -> None:
    check_number(key, value, "a probability in [0, 1]", lambda v: 0.0 <= v <= 1.0)


def check_positive(key: str, value: Any) -> None:
    check_number(key, value, "an integer > 0", lambda v: v > 0, integer=True)


def check_bool(key: str, value: Any) -> None:
    check(isinstance(value, bool), key, f"{value!r} is not valid", "true, false")


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
        check_choice("norm.type", self.type, tuple(NORMS))
        check_choice("norm.placement", self.placement, PLACEMENTS)
        check_number("norm.mix_ratio", self.mix_ratio, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        _refuse(get_scheme(self.placement).norm_refusal(self))
        check_number("norm.dyt_alpha_init", self.dyt_alpha_init, "a number > 0", lambda v: v > 0)
        check_bool("norm.fixnorm", self.fixnorm)
        check_number("norm.eps", self.eps, "a number > 0", lambda v: v > 0)
        check_number("norm.scale_init", self.scale_init, "a number > 0, or null for sqrt(d_model)", lambda v: v > 0,
                     null=True)


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
            check_bool(f"regularizer.{key}", getattr(self, key))
        check_choice("regularizer.layerdrop_rates", self.layerdrop_rates, LAYERDROP_RATES)


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
    # Attention Residuals (Kimi Team 2026; layer_aggregation=attnres): layers per block, 1 = full AttnRes.
    attnres_block: int = 1
    # false: no bias in the attention projections (q, k, v, out; self and cross) nor in any norm
    # (LayerNorm's β, DyT's and Derf's β); the FFN keeps its own (x-transformers' default; PaLM and
    # LLaMA drop every bias). A research axis: how biases interact with normalisation.
    bias: bool = True
    # QK-norm (model/qk_norms.py) in every attention of both stacks: none | l2 (Henry et al. 2020,
    # logits g·q̂·k̂, g₀ = qk_norm_scale_init, null: log₂(L² − L) with L = max_positions) | rms (OLMo 2).
    qk_norm: str = "none"
    qk_norm_scale_init: float | None = None
    # Value residual (Zhou et al. 2024; model/attention.py): self-attention of layer n attends over
    # λ₁·V₁ + λ₂·V_n, V₁ the first layer's values of the same stack, λ learned (init 0.5).
    value_residual: bool = False
    # Attention-stability schemes (model/stability.py), in every attention of both stacks: gated attention
    # (Qiu et al. 2025: none | headwise | elementwise), a learned sink per head (gpt-oss), soft-capping of the
    # attention logits and of the vocabulary logits (Gemma 2: c·tanh(s/c), null = off), RMSNorm of each
    # head's keys / values without the queries' (x-transformers k_rmsnorm, value_rmsnorm).
    attn_gate: str = "none"
    attn_sink: bool = False
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    k_norm: bool = False
    v_norm: bool = False
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
            check_positive(f"model.{key}", getattr(self, key))
        check(self.d_model % self.encoder_heads == 0, "model.d_model",
              f"{self.d_model} is not divisible by model.encoder_heads={self.encoder_heads}")
        check(self.decoder_d_model % self.decoder_heads == 0, "model.decoder_d_model",
              f"{self.decoder_d_model} is not divisible by model.decoder_heads={self.decoder_heads}")
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            _prob(f"model.{key}", getattr(self, key))
        for key in ("learned_positions", "share_embeddings", "tie_output_embeddings", "value_residual", "bias",
                    "attn_sink", "k_norm", "v_norm"):
            check_bool(f"model.{key}", getattr(self, key))
        check(not self.share_embeddings or self.d_model == self.decoder_d_model, "model.share_embeddings",
              f"true needs model.d_model == model.decoder_d_model ({self.d_model} != {self.decoder_d_model})")
        check_choice("init.name", self.init, INITS)
        check_choice("norm.placement", self.norm.placement, PLACEMENTS)
        # every choice is checked before a combination of them, so a typo is named as itself
        check_choice("model.layer_aggregation", self.layer_aggregation, AGGREGATIONS)
        check_choice("model.layer_aggregation_stacks", self.layer_aggregation_stacks, AGGREGATION_STACKS)
        check_positive("model.attnres_block", self.attnres_block)
        check_choice("model.qk_norm", self.qk_norm, QK_NORMS)
        check_number("model.qk_norm_scale_init", self.qk_norm_scale_init, "a number > 0, or null for log2(L² - L), "
                     "L = model.max_positions", lambda v: v > 0, null=True)
        check_choice("model.attn_gate", self.attn_gate, ATTN_GATES)
        for key in ("attn_softcap", "logit_softcap"):
            check_number(f"model.{key}", getattr(self, key), "a number > 0 (the cap c of c·tanh(s/c)), or null for none",
                         lambda v: 0 < v < math.inf, null=True)  # inf: tanh(s/inf)·inf = nan everywhere
        check_choice("model.residual", self.residual, RESIDUALS)
        check_positive("model.residual_streams", self.residual_streams)
        check_choice("model.residual_mixing", self.residual_mixing, RESIDUAL_MIXINGS)
        # a value that does nothing would still rename the run (it is identity): refused, as norm.mix_ratio
        check(self.qk_norm_scale_init is None or self.qk_norm == "l2", "model.qk_norm_scale_init",
              f"{self.qk_norm_scale_init} with model.qk_norm={self.qk_norm}: only l2 QK-norm has a learned scale g "
              "(Henry et al. 2020); set model.qk_norm=l2 or leave the scale null")
        # x-transformers refuses qk_rmsnorm with k_rmsnorm alike: the keys would be normalised twice
        check(not self.k_norm or self.qk_norm == "none", "model.k_norm",
              f"true with model.qk_norm={self.qk_norm}: QK-norm already normalises the keys; choose one")
        self.norm.validate()
        _refuse(residual_refusal(self))  # placements other than pre-norm's, DLCL; keys unused by add
        self.regularizer.validate()
        _refuse(get_scheme(self.norm.placement).model_refusal(self))  # init=admin, DLCL, DWA
        # Under learned LayerDrop rates a gated-off layer still runs (its output is discarded,
        # regularizers/layerdrop.py), so a gated-off first layer would still set V₁ for the layers
        # after it: the model would differ from the one pruning leaves (the first kept layer's V₁).
        layerdrop = self.regularizer.encoder_layerdrop or self.regularizer.decoder_layerdrop
        check(not (self.value_residual and layerdrop and self.regularizer.layerdrop_rates == "learned"),
              "model.value_residual", "true with regularizer.layerdrop_rates=learned: a gated-off first layer "
              "would still give the value residual its V₁, which the pruned model (data-driven pruning) does "
              "not have; use regularizer.layerdrop_rates=uniform")
        if self.layer_aggregation != "none" or self.attnres_block != 1:
            self._check_aggregation()

    def _check_aggregation(self) -> None:
        # DLCL and DWA (model/aggregation.py); Admin's profile runs at init, where DWA is the identity,
        # so each sub-layer reads the previous one's output as Admin assumes: only DLCL refuses it.
        agg = self.layer_aggregation
        check(self.attnres_block == 1 or agg == "attnres", "model.attnres_block",
              f"{self.attnres_block} with model.layer_aggregation={agg}: only attnres reads it; leave it at 1")
        check(agg != "attnres" or get_scheme(self.norm.placement).pre_like, "model.layer_aggregation",
              f"attnres with norm.placement={self.norm.placement}: Attention Residuals replace the pre-norm "
              "stream's sum (Kimi Team 2026), which a placement that normalises the stream does not have; "
              "use a pre-norm placement (pre, subln, sandwich, reordered, pre_scaled)")
        check(self.init != "admin" or agg != "dlcl", "model.layer_aggregation",
              "dlcl with init=admin: Admin's ω profile assumes each sub-layer reads "
              "the previous one's output (Liu et al. 2020); DLCL feeds it a learned mix")
        for stack in ("encoder", "decoder"):
            p = getattr(self.regularizer, f"{stack}_layerdrop")
            check(p == 0 or self.layer_aggregation_stacks not in (stack, "both"), f"regularizer.{stack}_layerdrop",
                  f"{p} with model.layer_aggregation={agg} on the {stack}: a dropped layer's slot in {agg.upper()}'s "
                  "weighted history is undefined; set the rate to 0 or model.layer_aggregation_stacks")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
