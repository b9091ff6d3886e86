"""LayerDrop (Fan, Grave & Joulin 2019): skip each layer of a stack with probability p in training.

`LayerDropModuleList` is fairseq's `LayerDropModuleList` idea: a ModuleList whose *iterator* skips
layers while training, so a stack keeps its plain `for layer in self.layers` loop. A skipped layer
is the identity and the kept ones are not rescaled (the paper: "no rescaling"). In eval mode the
iterator yields every layer and draws nothing.

Randomness and DDP. The draws come from a private `torch.Generator` re-seeded at every training
forward from (seed, stack salt, draw counter); seed and counter live in the persistent buffer
`draw_state`, so:
- every DDP rank skips the same layers at the same forward (same seed from `seed_everything`, and
  DDP broadcasts buffers from rank 0 before each forward anyway), whatever the batch shapes on
  each rank did to the global RNG (dropout consumes it per element, so a shared global RNG would
  drift apart across ranks);
- the global torch RNG is never touched: a p = 0 list consumes no randomness, and dropout masks
  elsewhere are the same with or without LayerDrop;
- a resumed run continues the draw sequence (the counter is in the checkpoint).

Skipped layers and DDP. A layer skipped on every rank has no gradient; DDP without
`find_unused_parameters=True` then fails at the next step ("Expected to have finished reduction in
the prior iteration"). find_unused_parameters walks the autograd graph at every step. Instead a
skipped layer yields `x + 0·Σθ` over its own parameters and its other tensor inputs (the encoder
output, for a decoder layer: with every decoder layer skipped the encoder would otherwise get no
gradient): one reduction over the layer's weights (negligible next to running it), every parameter
gets a gradient (exactly zero), and DDP buckets stay identical across steps. We do this on one
process too, so one process and DDP train the same
way: the optimizer sees a zero gradient for a skipped layer, not a missing one (Adam's moments keep
decaying and moving it, as in fairseq whose `zero_grad` zeroed gradients rather than freeing them).

Data-driven rates (`rates="learned"`, the paper's data-driven pruning): per-layer logits w with
p_d = N·p·softmax(w)_d, so mean_d p_d = p exactly (clamped to ≤ 1, which can only lower the mean
when some N·p·softmax > 1). The gate uses the same uniform u_d as the fixed-rate case — keep iff
u_d ≥ p_d — and its gradient flows through a relaxed Bernoulli (Concrete, Maddison et al. 2017;
Jang et al. 2017) by the straight-through estimator: forward uses the hard gate g ∈ {0, 1}, backward
the gradient of g_soft = σ((logit(1−p_d) + logit(u_d)) / τ). Hence layer d computes
x + g·(F(x) − x): F runs even when the gate is 0 (no speed-up while learning rates, but every
parameter, w included, gets a gradient, so DDP is safe with no extra term). Fan et al. learn the
rates with the model under a mean-p constraint; the exact parametrisation here (softmax logits +
straight-through Concrete) is ours, chosen because it needs no extra sampling and no baseline.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

RATES = ("uniform", "learned")
TEMPERATURE = 2.0 / 3.0  # Concrete temperature recommended by Maddison et al. 2017


class _Proxy:
    # What the training iterator yields in place of a layer; attribute access reaches the layer, so
    # code that inspects `for layer in stack.layers` (named_children, parameters) still works.
    # (Inspection in training also advances the draw counter, identically on every rank.)
    def __getattr__(self, name: str):
        return getattr(self.__dict__["layer"], name)


class _Skipped(_Proxy):
    # A skipped layer: identity plus an exact zero that touches every parameter (see module doc).
    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return x
        # Its other inputs too: with every decoder layer skipped, the encoder output (memory) would
        # otherwise not reach the loss and the whole encoder would go without gradients.
        inputs = [a for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point()]
        zero = sum(t.sum() for t in (*self.layer.parameters(), *inputs) if t.requires_grad) * 0.0
        return x + zero.to(x.dtype)


class _Gated(_Proxy):
    # Learned-rate layer: forward x + g·(F(x) − x) with the straight-through gate g.
    def __init__(self, layer: nn.Module, gate: torch.Tensor):
        self.layer, self.gate = layer, gate

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.layer(x, *args, **kwargs)
        return x + self.gate.to(y.dtype) * (y - x)


class LayerDropModuleList(nn.ModuleList):
    def __init__(self, p: float, modules: Iterable[nn.Module] | None = None, rates: str = "uniform",
                 seed: int | None = None, salt: int = 0):
        super().__init__(modules)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"LayerDrop p={p!r} must be in [0, 1]")
        if rates not in RATES:
            raise ValueError(f"rates={rates!r}; allowed values: {', '.join(RATES)}")
        self.p, self.rates, self.salt = float(p), rates, int(salt)
        # seed defaults to the process's torch seed: identical on every rank after seed_everything.
        seed = torch.initial_seed() if seed is None else seed
        self.register_buffer("draw_state", torch.tensor([seed % (2 ** 62), 0], dtype=torch.long))
        if rates == "learned":
            self.rate_logits = nn.Parameter(torch.zeros(len(self)))  # uniform rates p at the start
        self.last_kept: list[int] = list(range(len(self)))  # layers run by the last forward

    def drop_rates(self) -> torch.Tensor:
        """Per-layer drop probabilities p_d, shape (N,): all p, or N·p·softmax(w) clamped to 1."""
        if self.rates == "uniform":
            return torch.full((len(self),), self.p)
        return (len(self) * self.p * torch.softmax(self.rate_logits, 0)).clamp(max=1.0)

    def _uniforms(self) -> torch.Tensor:
        seed, count = self.draw_state.tolist()
        g = torch.Generator(device="cpu")
        g.manual_seed((seed * 1_000_003 + self.salt * 7_919 + count) % (2 ** 63))
        self.draw_state[1] += 1
        return torch.rand(len(self), generator=g)  # (N,) on CPU: same numbers on every device

    def __iter__(self) -> Iterator:
        layers = list(super().__iter__())
        if not self.training or (self.p == 0.0) or not layers:
            self.last_kept = list(range(len(layers)))
            return iter(layers)
        u = self._uniforms()
        if self.rates == "uniform":
            keep = (u >= self.p).tolist()
            self.last_kept = [i for i, k in enumerate(keep) if k]
            return iter(layer if k else _Skipped(layer) for layer, k in zip(layers, keep))
        p_d = self.drop_rates()
        u = u.to(p_d.device).clamp(1e-6, 1 - 1e-6)
        hard = (u >= p_d).to(p_d.dtype)
        logit_keep = torch.log1p(-p_d.clamp(max=1 - 1e-6)) - torch.log(p_d.clamp(min=1e-6))
        soft = torch.sigmoid((logit_keep + torch.log(u) - torch.log1p(-u)) / TEMPERATURE)
        gate = hard + soft - soft.detach()  # (N,) value = hard, gradient = d soft
        self.last_kept = [i for i, h in enumerate(hard.tolist()) if h]
        return iter(_Gated(layer, gate[i]) for i, layer in enumerate(layers))

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # ModuleList would call our constructor with a list as p
            return self.subset(list(range(len(self)))[idx])
        return super().__getitem__(idx)

    def __repr__(self) -> str:
        # ModuleList's repr iterates `self`, which in training would draw (and advance the counter).
        lines = [f"({i}): " + repr(m).replace("\n", "\n  ") for i, m in enumerate(super().__iter__())]
        return f"LayerDropModuleList({self.extra_repr()}\n  " + "\n  ".join(lines) + "\n)"

    def subset(self, keep: list[int]) -> "LayerDropModuleList":
        """A list of the layers at `keep` (same objects) with the same settings; learned rates are
        sliced to the kept layers."""
        new = LayerDropModuleList(self.p, [self[i] for i in keep], self.rates, salt=self.salt)
        new.draw_state.copy_(self.draw_state)
        new.train(self.training)
        if self.rates == "learned":
            new.rate_logits.data.copy_(self.rate_logits.data[keep])
        return new

    def extra_repr(self) -> str:
        return f"p={self.p}, rates={self.rates}"


def layer_list(layers: Iterable[nn.Module], p: float, rates: str = "uniform", salt: int = 0) -> nn.ModuleList:
    """What a stack stores as `self.layers`: a plain ModuleList when LayerDrop is off (p = 0), so
    such checkpoints carry no LayerDrop state and p = 0 is the model without it. Learned rates with
    p = 0 would all be 0 (and their logits unused, which DDP rejects): also a plain list."""
    if p == 0.0:
        return nn.ModuleList(layers)
    return LayerDropModuleList(p, layers, rates, salt=salt)
