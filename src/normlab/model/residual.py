"""The residual connection around every sub-layer; what it computes is its scheme's (schemes/).

A ResidualBlock holds a sub-layer F, its norm N, the residual dropout and the parameters some
schemes add, under the names every checkpoint has: omega (Admin's ω, Liu et al. 2020: a trainable
vector of size d on the skip branch, created as ones and overwritten by the Admin init routine),
norm_out (Sandwich's second norm), alpha (DeepNorm's α, a persistent buffer: a pruned model keeps
the α it trained with) and scale (ReZero's a), and the buffers a scheme adds per layer (ln_scale,
LayerNorm Scaling's 1/√ℓ; post_norm, Mix-LN's choice). Its forward is its scheme's; the formulas
of every scheme are in schemes/__init__.py.
"""
from __future__ import annotations

import torch
from torch import nn

from normlab.model.dropout import Dropout
from normlab.model.schemes import get_scheme


class ResidualBlock(nn.Module):
    # `sublayer` is any module (self-attention, cross-attention, FFN); extra positional and keyword
    # arguments of forward (memory, masks, cache) go to it untouched, so one block type serves all.
    def __init__(self, sublayer: nn.Module, norm: nn.Module, d: int, placement: str, dropout: float,
                 omega: bool = False, alpha: float = 1.0, norm_out: nn.Module | None = None,
                 hyper: nn.Module | None = None, **state):
        super().__init__()
        self.scheme = get_scheme(placement)
        self.scheme.check_block(omega, norm_out)
        self.sublayer = sublayer
        self.norm = norm
        self.dropout = Dropout(dropout)  # .add(x, y) = x + dropout(y) in one pass on CPU
        self.omega = nn.Parameter(torch.ones(d)) if omega else None
        self.norm_out = norm_out
        self.scale = None
        self.scheme.add_state(self, alpha, **state)  # state: a scheme's per-layer values (schemes/)
        # Hyper-connections (model/hyper.py): the block's forward over n streams; None: one stream
        self.hyper = hyper

    @property
    def placement(self) -> str:
        return self.scheme.name

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        # The residual stream in the block's input (what diagnostics call x in ‖F(x)‖/‖x‖).
        # hyper-connections: the streams' mean, pre-norm's stream at their init (n equal copies)
        return self.scheme.stream(x) if self.hyper is None else x.mean(0)

    def forward(self, x: torch.Tensor, *args, layer_input: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        # layer_input: the layer's input, which a layer hands its last block (B2T, Takase et al. 2023)
        if self.hyper is not None:  # pre-norm's branch over n streams; layer_input is B2T's alone
            return self.hyper(self, x, *args, **kwargs)
        if layer_input is None:
            return self.scheme.forward(self, x, *args, **kwargs)
        return self.scheme.last_forward(self, x, layer_input, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"placement={self.placement}, omega={self.omega is not None}"
