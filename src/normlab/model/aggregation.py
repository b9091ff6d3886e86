"""How a stack runs its layers: one after the other, or with DLCL's learned combination of all
earlier outputs (Wang et al. 2019, "Learning Deep Transformer Models for Machine Translation").

The stack owns its layers (`stack.layers`, a ModuleList that LayerDrop may replace) and calls
`stack.aggregation(stack.layers, x, *args)`; the aggregation iterates them, so LayerDrop's
skipping iterator and the layer forwards are the same for every choice.

DLCL (model.layer_aggregation=dlcl, on model.layer_aggregation_stacks = encoder | decoder | both):
y_0 is the stack input (embedding), y_k the output of layer k, W a learned (L+1)×(L+1) lower-
triangular matrix initialised to the average (row l: 1/(l+1) on columns 0..l), as the authors'
code (wangqiangneu/dlcl, fairseq/modules/dlcl.py: init_value='avg', weight_type='scalar').
The input of layer l+1 (l = 0..L-1) and the stack output (l = L) are
  pre-norm-like placements:  Σ_{k≤l} W[l,k]·LN_k(y_k)       LN_0 = identity (normalize_embed off),
                             then the stack's final norm on the output;
  post-norm-like placements: LN_l(Σ_{k≤l} W[l,k]·y_k)        LN_0 = identity,
with one norm LN_k (norm.type) per layer. "Pre-like" are the schemes whose stream is never
normalised in a block (Scheme.pre_like in schemes/: pre, subln, sandwich, reordered, pre_scaled);
the others (post, deepnorm, rezero with the identity norm) use the post form, as the authors'
`normalize_before` switch does. ResiDual carries its own second stream, B2T its own skip over a
layer and Mix-LN mixes both forms: none combines with DLCL (their schemes refuse it), nor does
LayerDrop: a dropped layer's slot in the weighted history is not defined by either paper. Pruning a
DLCL stack removes the layer from the history: `subset(keep)` keeps W's rows and columns (and
norms) of the kept layers.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from normlab.model.norms import build_norm
from normlab.model.schemes import get_scheme

AGGREGATIONS = ("none", "dlcl")
AGGREGATION_STACKS = ("encoder", "decoder", "both")


class LayerChain(nn.Module):
    # x_{l+1} = layer_l(x_l): the plain Transformer stack.
    def forward(self, layers: nn.ModuleList, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        for layer in layers:
            x = layer(x, *args, **kwargs)
        return x

    def subset(self, keep: Sequence[int]) -> "LayerChain":
        return self


class DLCL(nn.Module):
    def __init__(self, n_layers: int, d: int, norm_cfg, pre: bool):
        super().__init__()
        self.pre = pre
        w = torch.ones(n_layers + 1, n_layers + 1).tril()
        self.weight = nn.Parameter(w / w.sum(dim=1, keepdim=True))  # (L+1, L+1), rows average
        self.norms = nn.ModuleList(build_norm(norm_cfg, d) for _ in range(n_layers))  # LN_1 .. LN_L

    def forward(self, layers: nn.ModuleList, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        history = [x]  # y_0, or LN_k(y_k) for pre-like placements
        for i, layer in enumerate(layers):
            y = layer(self._combine(history), *args, **kwargs)
            history.append(self.norms[i](y) if self.pre else y)
        return self._combine(history)

    def _combine(self, history: list[torch.Tensor]) -> torch.Tensor:
        row = len(history) - 1
        w = self.weight[row, : row + 1]  # (row+1,)
        out = torch.tensordot(w, torch.stack(history), dims=1)  # (row+1,) · (row+1, B, T, D) -> (B, T, D)
        return out if self.pre or row == 0 else self.norms[row - 1](out)

    def subset(self, keep: Sequence[int]) -> "DLCL":
        idx = torch.tensor([0] + [k + 1 for k in keep])  # y_0 and the kept layers' outputs
        new = copy.deepcopy(self)
        new.weight = nn.Parameter(self.weight.detach()[idx][:, idx].clone())
        new.norms = nn.ModuleList(new.norms[k] for k in keep)
        return new

    def extra_repr(self) -> str:
        return f"layers={len(self.norms)}, pre={self.pre}"


def build_aggregation(cfg, stack: str, n_layers: int, d: int) -> nn.Module:
    # cfg: a ModelConfig; stack: "encoder" or "decoder".
    if cfg.layer_aggregation == "dlcl" and cfg.layer_aggregation_stacks in (stack, "both"):
        return DLCL(n_layers, d, cfg.norm, pre=get_scheme(cfg.norm.placement).pre_like)
    return LayerChain()
