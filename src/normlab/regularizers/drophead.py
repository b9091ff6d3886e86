"""Scheduled DropHead (Zhou et al. 2020): drop whole attention heads, per example, in training.

A mask of shape (B, H) multiplies each head's output before the output projection (attention.py
applies it to SDPA's result, so the fused kernel is kept). Kept heads of a row are rescaled by
H / (number of kept heads of that row), as in the paper, so the per-row sum of the mask is H and,
by symmetry between heads, E[mask_bh] = 1 exactly: the expected attention output is unchanged.
A row whose draw keeps no head keeps one head chosen uniformly (scaled to H), so no row is ever
all-zero and the rescale never divides by zero, p = 1 included; this keeps the heads symmetric,
hence the expectation above still holds exactly.

Randomness comes from torch's global RNG (or a given generator), like dropout: masks are per
example, so DDP ranks need not agree on them. With p = 0 the hook is never called (attention.py
checks `drophead_p > 0`), so no randomness is consumed and outputs equal the model without it.
"""
from __future__ import annotations

import torch
from torch import nn

# Attention modules are recognised by their DropHead hook attribute, not imported: the model
# package imports this module (normlab.model.attention would import it back).
KINDS = ("encoder_self", "decoder_self", "cross")  # = normlab.model.attention.KINDS


def _attentions(model: nn.Module):
    return [m for m in model.modules() if hasattr(m, "head_mask_fn") and hasattr(m, "kind")]


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


def _mask_fn(module: nn.Module, batch_size: int) -> torch.Tensor:
    return drophead_mask(batch_size, module.num_heads, module.drophead_p, device=module.q_proj.weight.device)


def enabled_kinds(reg) -> tuple[str, ...]:
    """Attention kinds that DropHead applies to, from RegularizerConfig's three switches."""
    return tuple(k for k in KINDS if getattr(reg, f"drophead_{k}"))


def install_drophead(model: nn.Module, p: float, kinds: tuple[str, ...] = KINDS) -> list[nn.Module]:
    """Give every attention module of the chosen kinds the head-mask hook and rate p; returns them.
    Rate changes later go through `set_drophead_p` (the schedule callback)."""
    modules = [m for m in _attentions(model) if m.kind in kinds]
    for m in modules:
        m.head_mask_fn = _mask_fn
        m.drophead_p = float(p)
    return modules


def set_drophead_p(model: nn.Module, p: float) -> int:
    """Set the rate of every attention module that has the DropHead hook; returns how many."""
    n = 0
    for m in _attentions(model):
        if m.head_mask_fn is not None:
            m.drophead_p = float(p)
            n += 1
    return n
