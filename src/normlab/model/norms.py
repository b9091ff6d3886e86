"""Normalisation layers chosen by name (design rule 2: the norm is an injected module).

LayerNorm is torch's own. ScaleNorm follows Nguyen & Salazar 2019 ("Transformers without
Tears", eq. for ScaleNorm); RMSNorm follows Zhang & Sennrich 2019; DyT follows Zhu et al. 2025
("Transformers without Normalization"), Derf its successor (Chen et al. 2025, "Stronger
Normalization-Free Transformers", arXiv 2512.10938). `none` is the identity: ReZero (Bachlechner et al. 2020)
has no norm at all (norm.placement=rezero, the only placement that takes it).
`build_norm(..., bias=False)` (model.bias=false) builds every norm without its additive bias: LayerNorm's
β (torch's `bias=False`), DyT's and Derf's β; ScaleNorm and RMSNorm have none.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ScaleNorm(nn.Module):
    # Nguyen & Salazar 2019: ScaleNorm(x; g) = g · x / max(‖x‖₂, ε) with ONE learned scalar g per
    # norm, initialised to √d (the authors' code: ScaleNorm(embed_dim ** 0.5), eps 1e-5).
    def __init__(self, d: int, eps: float = 1e-5, scale_init: float | None = None):
        super().__init__()
        self.d = d
        self.eps = eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(d) if scale_init is None else float(scale_init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = widened(x)  # fp16: ‖x‖ passes 65504 from |x| ≈ 2900 at d 512 (NaN out; review)
        norm = torch.linalg.vector_norm(w, dim=-1, keepdim=True).clamp(min=self.eps)
        return (self.g * w / norm).to(x.dtype)

    def extra_repr(self) -> str:
        return f"d={self.d}, eps={self.eps}"


def widened(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 if it is fp16 or bf16, else x itself: where a norm computes its statistics. fp16's
    largest value is 65504, so x² overflows from |x| = 256 on (the residual stream that HybridNorm's
    QKV-norm reads gets there), and an ε of 1e-12 is 0 in fp16; bf16 keeps 8 bits of mantissa. The
    norm rounds its result to x's dtype once, at the end, as OLMo's and HF Llama's RMSNorm do
    (tests/test_qk_norm_precision.py); fp32 and fp64 inputs are computed exactly as without it."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def l2_normalized(x: torch.Tensor, gain: torch.Tensor | float | None = None) -> torch.Tensor:
    """gain · x/‖x‖ over the last dim (F.normalize, ε 1e-12), in fp32 for fp16 / bf16 x (widened) and
    rounded once to x's dtype: in fp16 that ε is 0, so a zero row gave 0/0, and ‖x‖ overflowed to
    inf from |x| ≈ 2900 at d 512 (rows of 0). QK-norm (Henry et al. 2020) and FixNorm (Nguyen &
    Salazar 2019) use it (tests/test_qk_norm_precision.py, tests/test_norm_precision.py)."""
    unit = F.normalize(widened(x), dim=-1)
    return (unit if gain is None else unit * gain).to(x.dtype)


class RMSNorm(nn.Module):
    # Zhang & Sennrich 2019: x / sqrt(mean(x²) + ε) · w — LayerNorm without re-centring or bias.
    # In fp32 for fp16 / bf16 inputs (widened), the gain included, then rounded once to x's dtype.
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.d = d
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = widened(x)
        return (w * torch.rsqrt(w.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)

    def extra_repr(self) -> str:
        return f"d={self.d}, eps={self.eps}"


class DyT(nn.Module):
    # Zhu et al. 2025: DyT(x) = γ ⊙ tanh(α·x) + β, α one learned scalar (init 0.5, the paper's default
    # and the authors' DynamicTanh(alpha_init_value=0.5)), γ = 1 and β = 0 vectors of size d. No
    # statistics of x are computed: a drop-in for every norm (norm.type=dyt). bias=False: no β
    # (model.bias=false; Megatron's DynamicTanh has the same switch, `dyt_bias`).
    def __init__(self, d: int, alpha_init: float = 0.5, bias: bool = True):
        super().__init__()
        self.d = d
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(d))
        self.register_parameter("bias", nn.Parameter(torch.zeros(d)) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.alpha * x) * self.weight
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"d={self.d}" + ("" if self.bias is not None else ", bias=False")


class Derf(nn.Module):
    # Chen et al. 2025 (arXiv 2512.10938), DyT's successor: Derf(x) = γ ⊙ erf(α·x + s) + β, α and s
    # learned scalars, γ = 1 and β = 0 vectors of size d. Init α = 0.5 (DyT's default, from which the
    # paper starts) and s = 0, as x-transformers' Derf(init_alpha=0.5, init_bias=0.). Like DyT, no
    # statistics of x are computed: a drop-in for every norm (norm.type=derf). bias=False drops β, the
    # output's additive bias, as LayerNorm's; s stays: one scalar inside erf, the shape of the
    # nonlinearity (where it is centred), not a bias added to the norm's output.
    def __init__(self, d: int, alpha_init: float = 0.5, shift_init: float = 0.0, bias: bool = True):
        super().__init__()
        self.d = d
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.shift = nn.Parameter(torch.tensor(float(shift_init)))
        self.weight = nn.Parameter(torch.ones(d))
        self.register_parameter("bias", nn.Parameter(torch.zeros(d)) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.erf(self.alpha * x + self.shift) * self.weight
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"d={self.d}" + ("" if self.bias is not None else ", bias=False")


NORMS: dict[str, type[nn.Module]] = {
    "layernorm": nn.LayerNorm,
    "scalenorm": ScaleNorm,
    "rmsnorm": RMSNorm,
    "dyt": DyT,
    "derf": Derf,
    "none": nn.Identity,
}


def build_norm(cfg, d: int, bias: bool = True) -> nn.Module:
    # cfg: a NormConfig (normlab.config), which imports NORMS from here for its choice list.
    # bias: ModelConfig.bias (model.bias), which is a model key, not a norm one: it also removes the
    # attention projections' biases (attention.py), so the caller hands it down.
    if cfg.type == "scalenorm":
        return ScaleNorm(d, eps=cfg.eps, scale_init=cfg.scale_init)
    if cfg.type == "dyt":
        return DyT(d, alpha_init=cfg.dyt_alpha_init, bias=bias)
    if cfg.type == "derf":
        return Derf(d, bias=bias)
    if cfg.type == "none":
        return nn.Identity()
    if cfg.type == "layernorm":
        return nn.LayerNorm(d, eps=cfg.eps, bias=bias)
    return NORMS[cfg.type](d, eps=cfg.eps)  # RMSNorm: no bias to drop
