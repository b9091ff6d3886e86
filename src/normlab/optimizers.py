"""The optimizer a run trains with (optim.optimizer), and AdamW's named parameter groups (issue 38).

- `adam` (the default): torch.optim.Adam over every parameter in `model.parameters()` order, its
  `weight_decay` the coupled L2 penalty on every parameter: the path every run before took.
- `adamw`: decoupled weight decay (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization":
  p <- p - lr·wd·p beside the Adam step, not added to the gradient), applied to the weight matrices of
  the linear layers only by default. The groups follow what nanoGPT, OLMo-core and torchtitan exempt:

    matrices    the weights of nn.Linear (attention projections, FFN): always decayed
    embeddings  nn.Embedding weights: token embeddings, learned position embeddings, the untied output
                projection (a tied one is the token embedding itself)
    gains       the parameters of normalisation layers (LayerNorm / RMSNorm gains, ScaleNorm's g,
                DyT's and Derf's α and weights), their biases aside
    biases      every parameter named `bias`
    scheme      everything else: the schemes' own scalars and small matrices (ReZero's α, Admin's ω,
                DLCL / DWA weights, hyper-connection weights, QK-norm's g, differential attention's λ,
                FixNorm's g, gated attention's W_θ, the attention sinks' logits)

  `optim.no_decay` names the groups that are not decayed (default: all but matrices); each group's
  members are listed in the run log.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from normlab.model import norms

log = logging.getLogger("normlab")

OPTIMIZERS = ("adam", "adamw")
GROUPS = ("matrices", "embeddings", "gains", "biases", "scheme")
EXEMPTABLE = GROUPS[1:]  # optim.no_decay's choices: the matrices are what decay is for
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, norms.ScaleNorm, norms.RMSNorm, norms.DyT, norms.Derf)


def parameter_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Every parameter of `model` once (a tied tensor under its first name), in one of GROUPS, in
    `model.parameters()` order within each group."""
    owner: dict[int, nn.Module] = {}
    for _, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out: dict[str, list] = {g: [] for g in GROUPS}
    for name, p in model.named_parameters():  # each shared tensor once
        module = owner[id(p)]
        if id(p) in embedding:
            group = "embeddings"
        elif name.rsplit(".", 1)[-1] == "bias":
            group = "biases"
        elif isinstance(module, nn.Linear) and p is module.weight:
            group = "matrices"
        elif isinstance(module, NORM_TYPES):
            group = "gains"
        else:
            group = "scheme"
        out[group].append((name, p))
    return out


def build_optimizer(model: nn.Module, spec, lr: float, impl: dict) -> torch.optim.Optimizer:
    """The run's optimizer at peak `lr`, with the implementation flags `impl` (foreach / fused:
    lit_module._adam_impl); `spec` an OptimSpec."""
    common = {"lr": lr, "betas": tuple(spec.betas), "eps": spec.eps, **impl}
    if spec.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), weight_decay=spec.weight_decay, **common)
    groups = parameter_groups(model)
    exempt = set(spec.no_decay)
    for line in describe(groups, exempt, spec.weight_decay):
        log.info(line)
    return torch.optim.AdamW([{"params": [p for _, p in members], "weight_decay": 0.0 if g in exempt
                               else spec.weight_decay, "group": g} for g, members in groups.items() if members],
                             **common)


def describe(groups: dict[str, list], exempt: set[str], weight_decay: float) -> list[str]:
    """The run log's lines: one per group, its decay, size and members."""
    lines = []
    for g, members in groups.items():
        if members:
            wd = 0.0 if g in exempt else weight_decay
            n = sum(p.numel() for _, p in members)
            lines.append(f"optim adamw group {g}: weight_decay {wd:g}, {len(members)} tensors, {n:,} parameters: "
                         + ", ".join(name for name, _ in members))
    return lines
