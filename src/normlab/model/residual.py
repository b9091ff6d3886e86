"""The residual connection around every sub-layer: the ONLY place that knows pre- vs post-norm.

post (Vaswani et al. 2017):      x = N(x·ω + drop(F(x)))   (ω only with Admin, else ω = 1)
pre  (Wang et al. 2019):         x = x + drop(F(N(x)))     (+ one final N per stack: `final_norm`)
Admin (Liu et al. 2020):         ω is a trainable vector of size d on the skip branch; it is
created here as ones and overwritten by the Admin init routine (profiling or closed form).
"""
from __future__ import annotations

import torch
from torch import nn

from normlab.model.norms import build_norm

PLACEMENTS = ("post", "pre")


class ResidualBlock(nn.Module):
    # `sublayer` is any module (self-attention, cross-attention, FFN); extra positional and keyword
    # arguments of forward (memory, masks, cache) go to it untouched, so one block type serves all.
    def __init__(self, sublayer: nn.Module, norm: nn.Module, d: int, placement: str, dropout: float,
                 omega: bool = False):
        super().__init__()
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r}; allowed values: {', '.join(PLACEMENTS)}")
        if omega and placement != "post":
            raise ValueError("Admin's omega is defined for post-norm residuals (Liu et al. 2020)")
        self.sublayer = sublayer
        self.norm = norm
        self.placement = placement
        self.dropout = nn.Dropout(dropout)
        self.omega = nn.Parameter(torch.ones(d)) if omega else None

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        # The residual stream in the block's input (what diagnostics call x in ‖F(x)‖/‖x‖).
        return x

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.placement == "pre":
            return x + self.dropout(self.sublayer(self.norm(x), *args, **kwargs))
        out = self.sublayer(x, *args, **kwargs)
        skip = x if self.omega is None else x * self.omega
        return self.norm(skip + self.dropout(out))

    def extra_repr(self) -> str:
        return f"placement={self.placement}, omega={self.omega is not None}"


def final_norm(cfg, d: int) -> nn.Module:
    # Pre-norm leaves the residual stream un-normalised, so each stack ends with one more N
    # (Wang et al. 2019; Nguyen & Salazar 2019). Post-norm's last sub-layer already normalised.
    return build_norm(cfg, d) if cfg.placement == "pre" else nn.Identity()
