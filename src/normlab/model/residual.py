"""The residual connection around every sub-layer: the ONLY place that knows pre- vs post-norm.

post (Vaswani et al. 2017):      x = N(x·ω + drop(F(x)))   (ω only with Admin, else ω = 1)
pre  (Wang et al. 2019):         x = x + drop(F(N(x)))     (+ one final N per stack: `final_norm`)
Admin (Liu et al. 2020):         ω is a trainable vector of size d on the skip branch; it is
created here as ones and overwritten by the Admin init routine (profiling or closed form).
"""
from __future__ import annotations

import torch
from torch import nn

from normlab.config import NormConfig
from normlab.model.norms import build_norm


class ResidualBlock(nn.Module):
    # `sublayer` is any module (self-attention, cross-attention, FFN); extra positional and keyword
    # arguments of forward (memory, masks, cache) go to it untouched, so one block type serves all.
    def __init__(self, sublayer: nn.Module, norm: nn.Module, d: int, placement: str, dropout: float,
                 omega: bool = False):
        super().__init__()
        if placement not in ("pre", "post"):
            raise ValueError(f"placement={placement!r}; allowed values: pre, post")
        if omega and placement != "post":
            raise ValueError("Admin's omega is defined for post-norm residuals (Liu et al. 2020)")
        self.sublayer = sublayer
        self.norm = norm
        self.placement = placement
        self.dropout = nn.Dropout(dropout)
        self.omega = nn.Parameter(torch.ones(d)) if omega else None
        # Diagnostics hook: set `record_ratio = True` and read `last_ratio` = ‖F(x)‖/‖x‖ (Frobenius
        # over the batch, before dropout, detached). Off by default: one attribute check per call.
        self.record_ratio = False
        self.last_ratio: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.placement == "pre":
            out = self.sublayer(self.norm(x), *args, **kwargs)
            self._record(out, x)
            return x + self.dropout(out)
        out = self.sublayer(x, *args, **kwargs)
        self._record(out, x)
        skip = x if self.omega is None else x * self.omega
        return self.norm(skip + self.dropout(out))

    def _record(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if self.record_ratio:
            self.last_ratio = (out.detach().norm() / x.detach().norm().clamp(min=1e-12))

    def extra_repr(self) -> str:
        return f"placement={self.placement}, omega={self.omega is not None}"


def final_norm(cfg: NormConfig, d: int) -> nn.Module:
    # Pre-norm leaves the residual stream un-normalised, so each stack ends with one more N
    # (Wang et al. 2019; Nguyen & Salazar 2019). Post-norm's last sub-layer already normalised.
    return build_norm(cfg, d) if cfg.placement == "pre" else nn.Identity()
