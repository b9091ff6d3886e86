"""Dropout (Srivastava et al. 2014) with a faster mask on CPU, and dropout fused with the residual add.

torch's CPU dropout draws one Bernoulli variate per element from a serial generator (with MKL, a
float per element first), which makes it several times slower than a matmul over the same
activations: measured 26 ms for 4M elements vs 7 ms for the (4096 x 1024) @ (1024 x 256) matmul
that produced them. Here each 64-bit draw of torch's generator gives four 16-bit uniforms u, and
an element is kept iff u >= round(p · 2^16): the drop probability is p to within 2^-17 and kept
elements are scaled by 1 / P(keep) with the exact P(keep), so E[dropout(x)] = x exactly. The mask
is kept as bool (1 byte per element, not torch's 4-byte float mask) for the backward.

Elsewhere (GPU: torch's fused kernel; torch.compile: inductor's own RNG; p = 0 or 1) this is
`F.dropout`. Randomness comes from torch's default generator in every case, so runs are
reproducible under `torch.manual_seed` / `seed_everything`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from normlab.private_api import global_module_hooks, module_hooks

_LEVELS = 1 << 16


def _keep_mask(x: torch.Tensor, drop: int) -> torch.Tensor:
    # (x.shape) bool, True with probability 1 - drop / 2^16: four int16 uniforms per int64 draw.
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(1 << 63), None)
    u = bits.view(torch.int16)  # uniform on [-2^15, 2^15)
    u = (u if n % 4 == 0 else u[:n]).view(x.shape)  # the slice only when it cuts: one op less per call
    return u >= drop - (1 << 15)


class _CpuDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor | None, drop: int):
        keep = _keep_mask(x, drop)
        ctx.scale, ctx.residual = _LEVELS / (_LEVELS - drop), residual is not None
        ctx.save_for_backward(keep)
        out = x.mul(keep).mul_(ctx.scale)  # x * 0 at dropped positions, as torch's: a NaN stays NaN
        if residual is None:
            return out
        # in place only at one dtype: under autocast the branch is bf16 and the residual stream fp32,
        # which `residual + dropout(x)` keeps in fp32 (an in-place add would round it to bf16)
        return out.add_(residual) if out.dtype == residual.dtype else residual + out

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), grad if ctx.residual else None, None


def _fast(x: torch.Tensor, p: float, training: bool) -> int | None:
    # The drop count out of 2^16 when the CPU mask applies, else None.
    if not training or x.device.type != "cpu" or torch.compiler.is_compiling() or not x.is_floating_point():
        return None
    drop = round(p * _LEVELS)
    return drop if 0 < drop < _LEVELS else None


class Dropout(nn.Dropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._identity():
            return x
        drop = _fast(x, self.p, self.training)
        return F.dropout(x, self.p, self.training) if drop is None else _CpuDropout.apply(x, None, drop)

    def _identity(self) -> bool:
        # p = 0 or eval: F.dropout would return x itself (ATen's dropout returns its input then, on
        # every device), so skip its Python and its op: 23 calls per forward at the tiny shape without
        # dropout (issue 21).
        return self.p == 0.0 or not self.training

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x), in one pass and one new tensor on CPU. With forward hooks on this
        module (Admin's authors' profiling measures Var[drop(F(x))]) it is residual + self(x), so
        the hooks see the dropped branch."""
        if module_hooks(self) or global_module_hooks():
            return residual + self(x)
        if self._identity():
            return residual + x
        drop = _fast(x, self.p, self.training)
        if drop is None:
            return residual + F.dropout(x, self.p, self.training)
        return _CpuDropout.apply(x, residual, drop)
