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
- `muon`: torch.optim.Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
  networks") on the matrices group, the attention and FFN projections, and AdamW as above on every
  other group (embeddings and the output projection, gains, biases, the schemes' parameters), as the
  modded-nanogpt speedrun and OLMo-core split them. Muon's update is orthogonalised momentum, whose
  RMS does not depend on the gradient's scale; torch's `adjust_lr_fn="match_rms_adamw"` scales each
  matrix's rate by 0.2·√max(rows, cols) so that the update's RMS matches AdamW's (Liu et al. 2025,
  "Muon is Scalable for LLM Training", Moonlight), with which, its docs say, Muon reuses AdamW's
  learning rate and weight decay: both parts take optim.lr (the schedule scales every group alike) and
  optim.weight_decay; Muon's other settings are torch's (momentum 0.95, Nesterov, 5 Newton-Schulz steps).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from normlab.model import norms

log = logging.getLogger("normlab")

OPTIMIZERS = ("adam", "adamw", "muon")
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
    for line in describe(groups, exempt, spec.weight_decay, spec.optimizer):
        log.info(line)
    muon = spec.optimizer == "muon"  # the matrices to Muon, the rest to AdamW
    adamw = [{"params": [p for _, p in members], "weight_decay": 0.0 if g in exempt else spec.weight_decay,
              "group": g} for g, members in groups.items() if members and not (muon and g == "matrices")]
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(adamw, **common)
    matrices = [{"params": [p for _, p in groups["matrices"]], "group": "matrices"}]
    return MuonWithAdamW(matrices, adamw, {"lr": lr, "weight_decay": spec.weight_decay,
                                           "adjust_lr_fn": "match_rms_adamw"}, common)


def describe(groups: dict[str, list], exempt: set[str], weight_decay: float, optimizer: str = "adamw") -> list[str]:
    """The run log's lines: one per group, its decay, size and members (under muon, which part has it)."""
    lines = []
    for g, members in groups.items():
        if members:
            wd = 0.0 if g in exempt else weight_decay
            n = sum(p.numel() for _, p in members)
            part = ("" if optimizer == "adamw" else "muon (lr x 0.2·√max(rows, cols)), " if g == "matrices"
                    else "adamw, ")
            lines.append(f"optim {optimizer} group {g}: {part}weight_decay {wd:g}, {len(members)} tensors, "
                         f"{n:,} parameters: " + ", ".join(name for name, _ in members))
    return lines


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on `muon_groups` and torch.optim.AdamW on `adamw_groups`, stepped as one
    optimizer. One, not two: Lightning's automatic optimization (gradient accumulation, clipping, the
    precision plugins' unscaling and skipping, the LR scheduler) drives a single optimizer, and two
    would need manual optimization, each of those by hand. Its param_groups are the two optimizers'
    own group dicts (the scheduler's rate reaches both) and its state one dict that both use (their
    parameters are disjoint), so torch's state_dict / load_state_dict of the whole hold everything."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], muon: dict, adamw: dict):
        self.muon = torch.optim.Muon(muon_groups, **muon)
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._share()

    def _share(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning's closure: forward and backward of the update
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: the parts use them
        self._share()
