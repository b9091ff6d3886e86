"""How a stack runs its layers: one after the other, with DLCL's learned combination of all
earlier outputs (Wang et al. 2019, "Learning Deep Transformer Models for Machine Translation"), or
with DenseFormer's depth-weighted average after each layer (Pagliardini et al. 2024).

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

DWA (model.layer_aggregation=dwa, same stacks): DenseFormer's depth-weighted average (Pagliardini
et al. 2024, "DenseFormer: Enhancing Information Flow in Transformers via Depth Weighted
Averaging"; epfml/DenseFormer, DWAModules). x_0 is the stack input, y_i = layer_i(x'_{i-1}) with
x'_0 = x_0, and after every layer i = 1..L
  x'_i = α[i-1, 0]·x_0 + Σ_{1≤j≤i} α[i-1, j]·y_j,
α a learned L×(L+1) matrix initialised to the identity (α[i-1, i] = 1, the rest 0, as the authors'
`_init_weights`), so an untrained DWA stack is the plain stack, exactly. x'_L goes to the final
norm. It differs from DLCL in three ways: it averages the raw layer outputs (no per-layer norm,
whatever the placement: DenseFormer's blocks are pre-LN and it stores their outputs as they are),
it starts as the identity, not the average, and it has no row for the first layer's input. The
paper's dilation k (average only over every k-th earlier output) and period p (average only after
every p-th layer) trade a little perplexity for speed in deep LMs; this is the plain 1x1
DenseFormer (k = p = 1). It is defined per stack (the paper is decoder-only); the decoder's average
is per position, so cached incremental decoding needs nothing. LayerDrop is refused as for DLCL:
neither paper defines a dropped layer's slot, and LayerDrop's iterator hides which layers ran, so
the rows read would be the wrong ones. Pruning keeps the kept layers' rows (the averages after
them) and columns (their outputs): a pruned layer leaves the history, which is what skipping it
means here (tests/test_aggregation_dwa.py).
ResiDual (a second stream) and B2T (a layer adds its own input past its sub-layers) carry their own
cross-layer connection: DWA refuses them (their scheme's `no_dwa`); every other scheme's block output is one
stream, which DWA averages.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from normlab.model.norms import build_norm, widened
from normlab.model.schemes import get_scheme

AGGREGATIONS = ("none", "dlcl", "dwa", "attnres")
AGGREGATION_STACKS = ("encoder", "decoder", "both")


class LayerChain(nn.Module):
    # x_{l+1} = layer_l(x_l): the plain Transformer stack.
    def forward(self, layers: nn.ModuleList, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        for layer in layers:
            x = layer(x, *args, **kwargs)
        return x

    def subset(self, keep: Sequence[int]) -> "LayerChain":
        return self


def weighted_sum(w: torch.Tensor, history: list[torch.Tensor]) -> torch.Tensor:
    # Σ_k w[k]·history[k] in one contraction: (K,) · (K, B, T, D) -> (B, T, D), in the stream's own
    # dtype: under autocast a contraction (a matmul) would run in bf16 and round the fp32 residual
    # stream after every layer (the DenseFormer authors sum alpha * acc elementwise, which autocast
    # leaves alone). With w one-hot (DWA's init) every other product is ±0, so the sum is the chosen
    # entry bit for bit. (The stacked history is saved for backward at each layer: memory grows with
    # L², as in DLCL's authors' code, which concatenates it.)
    stacked = torch.stack(history)
    with torch.autocast(stacked.device.type, enabled=False):
        return torch.tensordot(w.to(stacked.dtype), stacked, dims=1)


def _kept(weight: torch.Tensor, rows: list[int], cols: list[int]) -> nn.Parameter:
    # The kept rows and columns of an aggregation matrix, a fresh parameter (pruning).
    idx_r, idx_c = torch.tensor(rows), torch.tensor(cols)
    return nn.Parameter(weight.detach()[idx_r][:, idx_c].clone())


class DLCL(nn.Module):
    def __init__(self, n_layers: int, d: int, norm_cfg, pre: bool, bias: bool = True):
        super().__init__()
        self.pre = pre
        w = torch.ones(n_layers + 1, n_layers + 1).tril()
        self.weight = nn.Parameter(w / w.sum(dim=1, keepdim=True))  # (L+1, L+1), rows average
        # LN_1 .. LN_L; bias: model.bias (without it, no norm has a bias)
        self.norms = nn.ModuleList(build_norm(norm_cfg, d, bias) for _ in range(n_layers))

    def forward(self, layers: nn.ModuleList, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        history = [x]  # y_0, or LN_k(y_k) for pre-like placements
        for i, layer in enumerate(layers):
            y = layer(self._combine(history), *args, **kwargs)
            history.append(self.norms[i](y) if self.pre else y)
        return self._combine(history)

    def _combine(self, history: list[torch.Tensor]) -> torch.Tensor:
        row = len(history) - 1
        out = weighted_sum(self.weight[row, : row + 1], history)
        return out if self.pre or row == 0 else self.norms[row - 1](out)

    def subset(self, keep: Sequence[int]) -> "DLCL":
        idx = [0] + [k + 1 for k in keep]  # y_0 and the kept layers' outputs
        new = copy.deepcopy(self)
        new.weight = _kept(self.weight, idx, idx)
        new.norms = nn.ModuleList(new.norms[k] for k in keep)
        return new

    def extra_repr(self) -> str:
        return f"layers={len(self.norms)}, pre={self.pre}"


class DWA(nn.Module):
    # DenseFormer's depth-weighted average (module docstring): x'_i = Σ_{j≤i} α[i-1, j]·x_j.
    def __init__(self, n_layers: int):
        super().__init__()
        w = torch.zeros(n_layers, n_layers + 1)
        w[:, 1:] = torch.eye(n_layers)  # α[i-1, i] = 1: the identity (the authors' init)
        # A bare Parameter, not an nn.Linear: the model's Xavier init (initialization.py) passes it
        # by, which the authors' README warns their nn.Linear weights need re-initialising after.
        self.weight = nn.Parameter(w)  # (L, L+1), row i-1 read after layer i, lower-triangular

    def forward(self, layers: nn.ModuleList, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        history = [x]  # x_0, then the raw layer outputs y_1 .. y_i (never the averages)
        for i, layer in enumerate(layers):
            history.append(layer(x, *args, **kwargs))
            x = weighted_sum(self.weight[i, : i + 2], history)
        return x

    def subset(self, keep: Sequence[int]) -> "DWA":
        new = copy.deepcopy(self)
        new.weight = _kept(self.weight, list(keep), [0] + [k + 1 for k in keep])
        return new

    def extra_repr(self) -> str:
        return f"layers={self.weight.shape[0]}"


class AttnRes(nn.Module):
    # Attention Residuals (module docstring): h_l = Σ_i softmax_i(w_lᵀ·RMSNorm(v_i))·v_i over the sources.
    def __init__(self, n_layers: int, d: int, block: int = 1, eps: float = 1e-5):
        super().__init__()
        self.block, self.eps = block, eps
        # w_1 .. w_L and the output's; 0: uniform weights at init (the authors'). A bare Parameter: the
        # Xavier init passes it by (initialization.py). w_1 weighs one source (v_0) and never learns; it
        # is kept so that each layer owns its query when pruning removes layers before it.
        self.query = nn.Parameter(torch.zeros(n_layers + 1, d))  # (L+1, D)

    def forward(self, layers: nn.ModuleList, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        done, partial = [x], None  # finished sources (v_0, then blocks), the block in progress
        for i, layer in enumerate(layers):
            h = self.attend(i, done if partial is None else done + [partial])
            v = layer(h, *args, **kwargs) - h  # f_i(h_i): the layer's contribution
            partial = v if partial is None else partial + v
            if (i + 1) % self.block == 0:
                done, partial = done + [partial], None
        return self.attend(len(layers), done if partial is None else done + [partial])

    def attend(self, row: int, sources: list[torch.Tensor]) -> torch.Tensor:
        values = torch.stack(sources)  # (N, B, T, D)
        w = widened(values)  # logits and softmax in fp32 under autocast (norms.widened)
        keys = w * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + self.eps)  # RMSNorm, no gain
        # the dot products as a product and a sum: elementwise ops keep fp32 under autocast, a matmul
        # would be cast back to bf16 (logits off by ~0.09 against fp64, review)
        alpha = torch.softmax((keys * self.query[row].to(w.dtype)).sum(-1), dim=0)  # (N, B, T): over the sources
        return (alpha.unsqueeze(-1) * w).sum(0).to(values.dtype)  # (B, T, D)

    def subset(self, keep: Sequence[int]) -> "AttnRes":
        new = copy.deepcopy(self)
        new.query = nn.Parameter(self.query.detach()[list(keep) + [self.query.size(0) - 1]].clone())
        return new

    def extra_repr(self) -> str:
        return f"layers={self.query.size(0) - 1}, block={self.block}"


def build_aggregation(cfg, stack: str, n_layers: int, d: int) -> nn.Module:
    # cfg: a ModelConfig; stack: "encoder" or "decoder".
    if cfg.layer_aggregation_stacks not in (stack, "both"):
        return LayerChain()
    if cfg.layer_aggregation == "dlcl":
        return DLCL(n_layers, d, cfg.norm, pre=get_scheme(cfg.norm.placement).pre_like, bias=cfg.bias)
    if cfg.layer_aggregation == "dwa":
        return DWA(n_layers)
    if cfg.layer_aggregation == "attnres":
        return AttnRes(n_layers, d, cfg.attnres_block, cfg.norm.eps)
    return LayerChain()
