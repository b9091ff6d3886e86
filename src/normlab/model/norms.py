"""Normalisation layers chosen by name (design rule 2: the norm is an injected module).

LayerNorm is torch's own. ScaleNorm follows Nguyen & Salazar 2019 ("Transformers without
Tears", eq. for ScaleNorm); RMSNorm follows Zhang & Sennrich 2019.
"""
from __future__ import annotations

import math

import torch
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
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=self.eps)
        return self.g * x / norm

    def extra_repr(self) -> str:
        return f"d={self.d}, eps={self.eps}"


class RMSNorm(nn.Module):
    # Zhang & Sennrich 2019: x / sqrt(mean(x²) + ε) · w — LayerNorm without re-centring or bias.
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.d = d
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight

    def extra_repr(self) -> str:
        return f"d={self.d}, eps={self.eps}"


NORMS: dict[str, type[nn.Module]] = {
    "layernorm": nn.LayerNorm,
    "scalenorm": ScaleNorm,
    "rmsnorm": RMSNorm,
}


def build_norm(cfg, d: int) -> nn.Module:
    # cfg: a NormConfig (normlab.config), which imports NORMS from here for its choice list.
    if cfg.type == "scalenorm":
        return ScaleNorm(d, eps=cfg.eps, scale_init=cfg.scale_init)
    return NORMS[cfg.type](d, eps=cfg.eps)
