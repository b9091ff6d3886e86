"""The Scheme base class and the registry of norm.placement names (see the package docstring)."""
from __future__ import annotations

import torch
from torch import nn

from normlab.model.norms import build_norm

MIX_RATIO = 0.25  # norm.mix_ratio's default: Mix-LN's α, its post-norm share of the layers (Li et al. 2025)
SCHEMES: dict[str, "Scheme"] = {}  # norm.placement -> its scheme, in the order of the choice list


# DenseFormer averages one stream of layer outputs (Pagliardini et al. 2024): a scheme with its own
# cross-layer connection (ResiDual's second stream, B2T's skip over the layer) refuses it with this
OWN_CROSS_LAYER = ("the scheme has its own cross-layer connection (a second stream or a skip over the layer); "
                   "choose one")


class Scheme:
    """A residual scheme: its block forward (on a ResidualBlock's norm, sublayer, dropout and own
    parameters), its stack's input and output, its initial scaling and its refused combinations.
    The defaults are the plain single-stream residual without a final norm or a scaling."""
    name = ""  # the norm.placement value; a subclass with a name registers itself
    paper = ""
    pre_like = False  # the stream is never normalised in a block: DLCL's pre form, a final N per stack
    norm_free = False  # ReZero: the one scheme with norm.type=none (and the only one that takes it)
    admin = False  # Admin's ω on the skip (Liu et al. 2020) is defined for post-norm only
    scale_cross = False  # whether the initial branch scaling includes cross-attention
    no_dlcl = ""  # why the scheme refuses DLCL (model.layer_aggregation=dlcl); "" = it takes it
    no_dwa = ""  # why it refuses DenseFormer's DWA (model.layer_aggregation=dwa); "" = it takes it
    constrained = False  # constrain_ changes weights (nGPT): code that makes weights (averaging) applies it
    mix_ratio = False  # whether it reads norm.mix_ratio (Mix-LN alone)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            SCHEMES[cls.name] = cls()

    # a stateless singleton: a copied or unpickled block shares it
    def __deepcopy__(self, memo) -> "Scheme":
        return self

    def __reduce__(self):
        return get_scheme, (self.name,)

    def __repr__(self) -> str:
        return self.name

    # ---- the residual block ------------------------------------------------------------------
    def check_block(self, omega: bool, norm_out: nn.Module | None) -> None:
        if omega and not self.admin:
            raise ValueError("Admin's omega is defined for post-norm residuals (Liu et al. 2020)")
        if norm_out is not None:
            raise ValueError("norm_out is the sandwich placement's second norm (and only its)")

    def add_state(self, block: nn.Module, alpha: float, **state) -> None:
        """The scheme's own parameters or buffers on the block (DeepNorm's α, ReZero's a); `state`:
        what its block_options gave beyond ResidualBlock's own arguments."""

    def block_options(self, cfg, d: int, stack: str, layer: int) -> dict:
        """ResidualBlock's keyword arguments this scheme needs (cfg: a ModelConfig) in layer `layer`
        (0-based) of `stack`. What depends on the layer's position is stored in the block (a
        buffer), never recomputed from a position that pruning changes."""
        return {}

    def forward(self, block: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def last_forward(self, block: nn.Module, x: torch.Tensor, layer_input: torch.Tensor, *args,
                     **kwargs) -> torch.Tensor:
        """The forward of a layer's last block, given the layer's input too (B2T's skip)."""
        return self.forward(block, x, *args, **kwargs)

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        # The residual stream in a block's input (what diagnostics call x in ‖F(x)‖/‖x‖).
        return x

    # ---- the stack -----------------------------------------------------------------------------
    def stream_input(self) -> nn.Module:
        return nn.Identity()

    # Whether a stack ends with one more N; None: when the scheme is pre-norm-like (pre_like).
    final_n: bool | None = None

    # Every norm a scheme builds takes `bias` (model.bias; norms.build_norm): with false, none has one.
    def final_norm(self, norm_cfg, d: int, bias: bool = True) -> nn.Module:
        # What each stack applies to its last layer's output. Pre-norm-like schemes leave the
        # residual stream un-normalised, so each stack ends with one more N (Wang et al. 2019; Nguyen &
        # Salazar 2019); post-norm's last sub-layer already normalised; ReZero has no norm.
        final = self.pre_like if self.final_n is None else self.final_n
        return build_norm(norm_cfg, d, bias) if final else nn.Identity()

    def inner_norm(self, norm_cfg, d: int, kind: str, bias: bool = True) -> nn.Module | None:
        """A norm inside the sub-layer of `kind` (encoder_self, decoder_self, cross, ffn), or None."""
        return None

    # ---- modules a scheme replaces (None: the model's own) and the constraint it keeps -------------
    def qk_norm(self, heads: int, head_dim: int, d: int) -> nn.Module | None:
        """The attention's q / k normalisation (the `query`, `key`, `sdpa_scale` of qk_norms.py's), or None."""
        return None

    def feed_forward(self, d: int, ffn: int, activation_dropout: float) -> nn.Module | None:
        return None

    def logit_scale(self, vocab_size: int, d: int) -> nn.Module | None:
        """A module whose output s (V,) scales the output logits, s ⊙ z, or None."""
        return None

    def constrain_(self, model: nn.Module) -> None:
        """What the scheme restores on the weights after the initialisation and after every optimizer
        step (nGPT's unit-norm matrices); nothing by default."""

    def branch_gains(self, n_enc: int, n_dec: int) -> dict[str, float]:
        """{stack: gain} for the Xavier weights of v, out, fc1, fc2 (initialization.py); {} = none."""
        return {}

    # ---- the combinations refused: (key, what) for config.ConfigError, or None -------------------
    def norm_refusal(self, norm) -> tuple[str, str] | None:
        if (norm.type == "none") != self.norm_free:
            return ("norm.type", f"{norm.type} with norm.placement={self.name}: ReZero (Bachlechner et al. 2020) "
                    "and nGPT (Loshchilov et al. 2025) are the placements without norm layers; use norm.type=none "
                    "exactly with norm.placement=rezero or ngpt")
        if norm.mix_ratio != MIX_RATIO and not self.mix_ratio:  # a no-op setting would rename the run
            return ("norm.mix_ratio", f"{norm.mix_ratio} with norm.placement={self.name}: only Mix-LN "
                    f"(norm.placement=mix) reads it; leave it at {MIX_RATIO}")
        return None

    def model_refusal(self, cfg) -> tuple[str, str] | None:
        if cfg.init == "admin" and not self.admin:
            return ("init", f"admin with norm.placement={self.name}: Admin is defined for post-norm models "
                    "(Liu et al. 2020); set norm.placement=post")
        if self.no_dlcl and cfg.layer_aggregation == "dlcl":
            return ("model.layer_aggregation", f"dlcl with norm.placement={self.name}: {self.no_dlcl}")
        if self.no_dwa and cfg.layer_aggregation == "dwa":
            return ("model.layer_aggregation", f"dwa with norm.placement={self.name}: {self.no_dwa}")
        return None


    def optim_warnings(self, optim) -> list[str]:
        """Lines for the run log about optimizer settings (an OptimSpec) that the scheme's paper rules
        out; the run applies them (a study may screen them per arm) and says so."""
        return []


def get_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise ValueError(f"placement={name!r}; allowed values: {', '.join(SCHEMES)}")
    return SCHEMES[name]
