"""The residual connection around every sub-layer: the ONLY place that knows the placements.

N is the norm (any norm type), F the sub-layer, drop the residual dropout (Vaswani et al. 5.4).
post      (Vaswani et al. 2017)       x = N(x·ω + drop(F(x)))      ω only with Admin, else 1
deepnorm  (Wang et al. 2022, DeepNet) x = N(α·x + drop(F(x)))      α per stack, a constant
pre       (Wang et al. 2019)          x = x + drop(F(N(x)))        + a final N per stack
subln     (Wang et al. 2022, Magneto) x = x + drop(F(N(x)))        + a final N; F has inner norms
sandwich  (Ding et al. 2021 CogView;  x = x + N_out(drop(F(N(x)))) + a final N
           Peri-LN, Kim et al. 2025)
rezero    (Bachlechner et al. 2020)   x = x + a·drop(F(x))         a a learned scalar, 0 at init;
                                                                    no norm (norm.type=none)
resi_dual (Xie et al. 2023)           (x, d) -> (N(x + f), d + f), f = drop(F(x)): a post-norm
                                      stream x and a dual stream d; the stack starts with d = x
                                      (its input) and outputs x + N_final(d).
Admin (Liu et al. 2020): ω is a trainable vector of size d on the skip branch; it is created here
as ones and overwritten by the Admin init routine (profiling or closed form).
DeepNorm's α = 0.81·(N⁴M)^(1/16) in the encoder, (3M)^(1/4) in the decoder (model/initialization.py
computes it with the paper's β) is a persistent buffer: a pruned model keeps the α it trained with.
ReZero: the authors' code (majumderb/rezero, RZTXEncoderLayer) shares one `resweight` between the
sub-layers of a layer; here each residual has its own a, the paper's x_{i+1} = x_i + α_i·F(x_i)
with a residual per sub-layer.
Sandwich: CogView's code applies the output dropout inside the sub-layer, then the third
LayerNorm, then the residual add: N_out(drop(F)), as here.
ResiDual: the dual stream is carried beside x in one tensor (2, B, T, D), so layers, LayerDrop
(a skipped layer leaves both streams unchanged) and pruning treat the pair as one value; the
authors' code (microsoft/ResiDual) passes a tuple (x, res), starts res = x·1.0 and ends with
x·1.0 + LN(res) (their LayerNorm eps 1e-7; here norm.eps).
"""
from __future__ import annotations

import torch
from torch import nn

from normlab.model.dropout import Dropout
from normlab.model.norms import build_norm

PLACEMENTS = ("post", "pre", "deepnorm", "subln", "sandwich", "rezero", "resi_dual")
FINAL_NORM = ("pre", "subln", "sandwich")  # placements whose stream is never normalised in a block


class ResidualBlock(nn.Module):
    # `sublayer` is any module (self-attention, cross-attention, FFN); extra positional and keyword
    # arguments of forward (memory, masks, cache) go to it untouched, so one block type serves all.
    def __init__(self, sublayer: nn.Module, norm: nn.Module, d: int, placement: str, dropout: float,
                 omega: bool = False, alpha: float = 1.0, norm_out: nn.Module | None = None):
        super().__init__()
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r}; allowed values: {', '.join(PLACEMENTS)}")
        if omega and placement != "post":
            raise ValueError("Admin's omega is defined for post-norm residuals (Liu et al. 2020)")
        if (norm_out is not None) != (placement == "sandwich"):
            raise ValueError("norm_out is the sandwich placement's second norm (and only its)")
        self.sublayer = sublayer
        self.norm = norm
        self.placement = placement
        self.dropout = Dropout(dropout)  # .add(x, y) = x + dropout(y) in one pass on CPU
        self.omega = nn.Parameter(torch.ones(d)) if omega else None
        self.norm_out = norm_out
        if placement == "deepnorm":
            self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = nn.Parameter(torch.zeros(())) if placement == "rezero" else None

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        # The residual stream in the block's input (what diagnostics call x in ‖F(x)‖/‖x‖).
        return x[0] if self.placement == "resi_dual" else x

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        p = self.placement
        if p in ("pre", "subln", "sandwich"):
            out = self.sublayer(self.norm(x), *args, **kwargs)
            if self.norm_out is None:
                return self.dropout.add(x, out)  # x + drop(out), one pass on CPU
            return x + self.norm_out(self.dropout(out))
        if p == "rezero":
            return x + self.scale * self.dropout(self.sublayer(x, *args, **kwargs))
        if p == "resi_dual":
            x, dual = x.unbind(0)  # (B, T, D) each
            out = self.dropout(self.sublayer(x, *args, **kwargs))
            return torch.stack((self.norm(x + out), dual + out))  # (2, B, T, D)
        out = self.sublayer(x, *args, **kwargs)  # post, deepnorm
        skip = x * self.omega if self.omega is not None else x * self.alpha if p == "deepnorm" else x
        return self.norm(self.dropout.add(skip, out))

    def extra_repr(self) -> str:
        return f"placement={self.placement}, omega={self.omega is not None}"


class DualStreamInput(nn.Module):
    # ResiDual: the dual stream starts as the stack's input (the authors' res = x·1.0).
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack((x, x))  # (2, B, T, D)


class DualStreamOutput(nn.Module):
    # ResiDual: the stack's output x_N + N(d_N) (Xie et al. 2023; the authors' x·1.0 + LN(res)).
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[0] + self.norm(h[1])


def stream_input(placement: str) -> nn.Module:
    return DualStreamInput() if placement == "resi_dual" else nn.Identity()


def final_norm(cfg, d: int) -> nn.Module:
    # What each stack applies to its last layer's output. Pre-norm-like placements leave the
    # residual stream un-normalised, so each stack ends with one more N (Wang et al. 2019; Nguyen &
    # Salazar 2019); post-norm's last sub-layer already normalised; ReZero has no norm; ResiDual
    # combines its two streams.
    if cfg.placement in FINAL_NORM:
        return build_norm(cfg, d)
    return DualStreamOutput(build_norm(cfg, d)) if cfg.placement == "resi_dual" else nn.Identity()
