"""Scheduled DropHead (Zhou et al. 2020): drop whole attention heads, per example, in training.

A mask of shape (B, H) multiplies each head's output before the output projection (attention.py
applies it to SDPA's result, so the fused kernel is kept). Kept heads of a row are rescaled by
H / (number of kept heads of that row), as in the paper, so the per-row sum of the mask is H and,
by symmetry between heads, E[mask_bh] = 1 exactly: the expected attention output is unchanged.
A row whose draw keeps no head keeps one head chosen uniformly (scaled to H), so no row is ever
all-zero and the rescale never divides by zero, p = 1 included; this keeps the heads symmetric,
hence the expectation above still holds exactly.

The regularizer is a module, `DropHead`, that the model injects into each attention module of
the chosen kinds (RegularizerConfig.drophead_{encoder_self,decoder_self,cross}); the others get
nn.Identity. Its rate `p` is a plain attribute that the schedule callback
(normlab.callbacks.drophead_schedule) sets before every batch.

Randomness comes from torch's global RNG (or a given generator), like dropout: masks are per
example, so DDP ranks need not agree on them. In eval mode, or with p = 0, the module returns its
input untouched and draws nothing, so outputs equal the model without it.
"""
from __future__ import annotations

import torch
from torch import nn


def drophead_mask(batch_size: int, num_heads: int, p: float, generator: torch.Generator | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """(B, H) float mask: 0 for dropped heads, H / kept_count(row) for kept ones."""
    u = torch.rand(batch_size, num_heads, generator=generator, device=device)  # (B, H)
    keep = u >= p
    empty = ~keep.any(dim=1)  # (B,)
    if empty.any():
        # Keep the head with the largest draw: uniform over heads, no extra randomness needed.
        keep[empty, u[empty].argmax(dim=1)] = True
    keep = keep.float()
    return keep * (num_heads / keep.sum(dim=1, keepdim=True))  # rows sum to H


class DropHead(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = float(p)

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        # heads: (B, H, T, Dh), each head's attention output before the heads are merged.
        if not self.training or self.p <= 0.0:
            return heads
        mask = drophead_mask(heads.size(0), heads.size(1), self.p, device=heads.device)  # (B, H)
        return heads * mask.to(heads.dtype)[:, :, None, None]

    def extra_repr(self) -> str:
        return f"p={self.p}"


def set_drophead_p(model: nn.Module, p: float) -> int:
    """Set the rate of every DropHead module of the model; returns how many there are."""
    modules = [m for m in model.modules() if isinstance(m, DropHead)]
    for m in modules:
        m.p = float(p)
    return len(modules)
