"""Admin initialisation (Liu et al. 2020, "Understanding the Difficulty of Training Transformers").

Every post-norm residual becomes x_i = N(x_{i-1}·ω_i + F_i(x_{i-1})) with a trainable vector ω_i
(residual.py). Admin sets ω before step 1 so that no residual branch dominates the output:

profile  ω_i = √(Σ_{j<i} Var[F_j]) with ω_1 = 1 (the paper), measured on real batches.
closed   ω_i = ω = √((N+1)/ln(N+1) − 1) for a stack of N residual sub-layers (the paper's
         O(log N) closed form: 2.017 at N=12, 2.335 at N=18, 3.041 at N=36).

How sub-layers are counted (the paper does not spell it out for encoder-decoders; this follows
the authors' code, which keeps one running sum per stack):
- encoder and decoder are separate stacks; each has its own i = 1, 2, ... and its own sum.
  Encoder layer l contributes 2 sub-layers (self-attn, FFN), decoder layer l contributes 3
  (self-attn, cross-attn, FFN), so N = 2·encoder_layers and N = 3·decoder_layers.
- j = 0 is the stack input x_0 (token embedding × √d + positions): the sum starts at Var[x_0].
  The paper's "Σ_{j<i}" with ω_1 = 1 only makes sense with such a term (else ω_2 = √Var[F_1] < 1
  for a branch that should be rescaled *up*); the authors' code starts from ratio 1 and adds
  Var[x_{i-1}·ω_i] + Var[F_i], which equals ours when the previous norm outputs unit variance
  (LayerNorm with weight 1, bias 0 does, up to ε). We use the paper's sum.
- ω_1 = 1 (the skip of the first sub-layer is the raw embedding), as the paper states.
- Var is the population variance over all features of all non-pad tokens of the profiling
  batches (the authors' code includes pads; pads are not data). The batches are concatenated
  (padding is exact: pad keys are masked, later target positions are hidden by the causal mask)
  so every ω_i sees the same tokens, and the model is in eval mode (no dropout; the authors'
  code profiles with dropout on, which inflates Var[F] by 1/(1−p)).
- The profiled value is a scalar; it fills the whole vector ω_i, which is then trained.

convention=authors (init.admin.convention) profiles as Transformer-Clinic does
(LiyuanLucasLiu/Transformer-Clinic, fairseq/modules/transformer_layer.py, init_type
adaptive-profiling): per stack a running ratio starts at 1; sub-layer i gets ω_i = ratio, then
ratio = √(Var[x_{i-1}·ω_i] + Var[drop(F_i(x_{i-1}))]), with x_{i-1} the block's input, the
variances over every position of the batch, pads included (np.var of the whole T×B×C tensor),
and the model in training mode (dropout on: embedding, attention, activation and residual
dropout). The authors profile on the first training batch: `init.admin.batches=1` reproduces
that; with more, the concatenated batches add padding. LayerDrop and DropHead stay off while
profiling (the authors' code has neither).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from normlab.model.attention import MultiheadAttention
from normlab.model.norms import RMSNorm, ScaleNorm
from normlab.regularizers.drophead import DropHead
from normlab.init.modes import MODES  # noqa: F401  (init.admin.mode; re-exported)
from normlab.regularizers.layerdrop import LayerDropModuleList

CONVENTIONS = ("paper", "authors")  # init.admin.convention


def closed_form_omega(n_sublayers: int) -> float:
    if n_sublayers < 1:
        raise ValueError(f"n_sublayers={n_sublayers} must be >= 1")
    n1 = n_sublayers + 1
    return math.sqrt(n1 / math.log(n1) - 1.0)


def _check_admin(model: nn.Module) -> None:
    for name, block in model.residual_blocks():
        if block.omega is None:
            raise ValueError(f"{name} has no omega: build the model with init=admin (post-norm)")


def _concat(batches: Iterable[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(batches)
    if not batches:
        raise ValueError("Admin profiling needs at least one batch")

    def cat(key: str) -> torch.Tensor:
        T = max(b[key].size(1) for b in batches)
        return torch.cat([nn.functional.pad(b[key], (0, T - b[key].size(1)), value=pad_id) for b in batches])

    return cat("src"), cat("tgt_in")  # (sum B, max S), (sum B, max T)


def _var(x: torch.Tensor, mask: torch.Tensor) -> float:
    return x[mask].double().var(unbiased=False).item()  # (tokens, D) -> all entries


@torch.no_grad()
def profile_omega_(model: nn.Module, batches: Iterable[dict], pad_id: int, convention: str = "paper") -> dict:
    """Set every ω_i by the profiling rule above; returns {name: {"omega", "var_f"}} per stack."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention={convention!r}; allowed values: {', '.join(CONVENTIONS)}")
    _check_admin(model)
    src, tgt_in = _concat(batches, pad_id)
    device = next(model.parameters()).device
    src, tgt_in = src.to(device), tgt_in.to(device)
    report: dict = {"enc": {}, "dec": {}}
    if convention == "authors":
        handles = _authors_hooks(model, report)
    else:
        handles = _paper_hooks(model, report, {"enc": src.ne(pad_id), "dec": tgt_in.ne(pad_id)})
    was_training = model.training
    model.train(convention == "authors")  # the authors' dropout; the paper's rule measures F itself
    for m in model.modules():
        if isinstance(m, (LayerDropModuleList, DropHead)):
            m.training = False  # this module only: its layers keep their dropout
    try:
        model(src, tgt_in)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return report


def _paper_hooks(model: nn.Module, report: dict, masks: dict) -> list:
    # masks: (B, S), (B, T), True = real token
    total: dict[str, float] = {}
    handles = []

    def on_input(key):
        def hook(module, args, out):
            total[key] = _var(out, masks[key])  # j = 0: the stack input x_0
            report[key]["input_var"] = total[key]
        return hook

    def before_block(key, name, first):
        def hook(module, args):
            module.omega.fill_(1.0 if first else math.sqrt(total[key]))
            report[key][name] = {"omega": module.omega[0].item()}
        return hook

    def after_sublayer(key, name):
        def hook(module, args, out):
            v = _var(out, masks[key])
            total[key] += v
            report[key][name]["var_f"] = v
        return hook

    for key, stack in model.stacks().items():
        handles.append(stack.embed.register_forward_hook(on_input(key)))
        for k, (name, block) in enumerate(stack.residual_blocks(key)):
            handles.append(block.register_forward_pre_hook(before_block(key, name, k == 0)))
            handles.append(block.sublayer.register_forward_hook(after_sublayer(key, name)))
    return handles


def _authors_hooks(model: nn.Module, report: dict) -> list:
    ratio = {"enc": 1.0, "dec": 1.0}
    var_in: dict[str, float] = {}
    handles = []

    def before_block(key, name):
        def hook(module, args):
            module.omega.fill_(ratio[key])
            var_in[key] = (args[0] * module.omega).double().var(unbiased=False).item()  # pads included
            report[key][name] = {"omega": ratio[key], "var_in": var_in[key]}
        return hook

    def after_dropout(key, name):
        def hook(module, args, out):
            v = out.double().var(unbiased=False).item()
            ratio[key] = math.sqrt(var_in[key] + v)
            report[key][name]["var_f"] = v
        return hook

    for key, stack in model.stacks().items():
        for name, block in stack.residual_blocks(key):
            handles.append(block.register_forward_pre_hook(before_block(key, name)))
            handles.append(block.dropout.register_forward_hook(after_dropout(key, name)))
    return handles


@torch.no_grad()
def closed_form_omega_(model: nn.Module) -> dict:
    _check_admin(model)
    report: dict = {}
    for key, stack in model.stacks().items():
        blocks = stack.residual_blocks(key)
        w = closed_form_omega(len(blocks))
        report[key] = {"n_sublayers": len(blocks)}
        for name, block in blocks:
            block.omega.fill_(w)
            report[key][name] = {"omega": w}
    return report


def omega_values(model: nn.Module) -> dict[str, list[float]]:
    return {name: block.omega.detach().cpu().tolist() for name, block in model.residual_blocks()
            if block.omega is not None}


# ---- export to a plain post-norm model -------------------------------------------------------
# Block i (i >= 2 in a stack) computes N_i(x·ω_i + F_i(x)) where x = N_{i-1}(b) is the previous
# block's norm output. Write x' = x ⊙ ω_i. Then
#   - the skip x·ω_i is x' itself, and
#   - F_i(x) = F_i'(x') where F_i' divides the input columns of F_i's first linear maps by ω_i
#     (q/k/v projections of self-attention, q of cross-attention — keys/values read the encoder
#     memory, not x —, fc1 of the FFN): W x = (W diag(1/ω)) (x ⊙ ω).
# So the plain block N_i(x' + F_i'(x')) is exact if N_{i-1} can output x' = x ⊙ ω_i directly:
#   LayerNorm γ⊙n(b)+β  -> γ⊙ω, β⊙ω   exact for any vector ω (needs elementwise affine)
#   RMSNorm   w⊙n(b)    -> w⊙ω        exact for any vector ω
#   ScaleNorm g·b/‖b‖   -> g·ω         exact only if ω is one scalar (all entries equal): ScaleNorm
#                                      has no per-feature parameter. After training ω is a general
#                                      vector, so a trained ScaleNorm+Admin model is not exportable.
# The first block of each stack (ω_1) has the embedding x_0 = E[w]·√d + PE as its skip, and no
# linear map precedes it that only this skip reads (the token table is shared with the other
# stack and the output layer, the sinusoidal table is fixed): exact only if ω_1 == 1, which holds
# at initialisation but not after ω_1 has been trained.

def _input_linears(sublayer: nn.Module) -> list[nn.Linear]:
    if isinstance(sublayer, MultiheadAttention):
        # gated attention's W_θ reads the queries' input too (model/stability.py): its columns fold alike
        gate = [] if sublayer.stability is None or sublayer.stability.gate is None else [sublayer.stability.gate]
        return [sublayer.q_proj, *gate] + ([] if sublayer.kind == "cross" else [sublayer.k_proj, sublayer.v_proj])
    if hasattr(sublayer, "fc1"):
        return [sublayer.fc1]
    raise TypeError(f"do not know the input linear maps of {type(sublayer).__name__}")


def _fold_into_norm(norm: nn.Module, omega: torch.Tensor, rtol: float) -> str | None:
    """Scale the norm's output by ω in place; a reason string if that is not exact."""
    if isinstance(norm, nn.LayerNorm):
        if norm.weight is None:
            return "LayerNorm without elementwise affine parameters"
        norm.weight.mul_(omega)
        if norm.bias is not None:
            norm.bias.mul_(omega)
        return None
    if isinstance(norm, RMSNorm):
        norm.weight.mul_(omega)
        return None
    if isinstance(norm, ScaleNorm):
        spread = (omega.max() - omega.min()).abs().item()
        norm.g.mul_(omega.mean())
        if spread > rtol * omega.abs().mean().item():
            return f"ScaleNorm has one scalar g; ω is a vector (spread {spread:.3g}), folded its mean"
        return None
    return f"unknown norm {type(norm).__name__}"


@torch.no_grad()
def export_post_norm(model: nn.Module, rtol: float = 1e-6, allow_inexact: bool = False):
    """(plain post-norm Seq2SeqTransformer without ω, report). Raises if a fold is not exact and
    allow_inexact is False; with allow_inexact the inexact blocks are approximated (ω_1 dropped,
    ScaleNorm gets the mean of ω) and listed in report['inexact']."""
    import copy

    from normlab.model.transformer import Seq2SeqTransformer

    _check_admin(model)
    work = copy.deepcopy(model).cpu().float()
    inexact: dict[str, str] = {}
    for key, stack in work.stacks().items():
        blocks = stack.residual_blocks(key)
        for k, (name, block) in enumerate(blocks):
            omega = block.omega.detach()
            if omega.abs().min().item() < 1e-12:
                raise ValueError(f"{name}: ω has a zero entry; cannot fold")
            if k == 0:
                if (omega - 1).abs().max().item() > rtol:
                    inexact[name] = (f"first sub-layer of the stack: skip is the embedding, ω_1 != 1 "
                                     f"(max |ω−1| = {(omega - 1).abs().max().item():.3g}), dropped")
                continue
            reason = _fold_into_norm(blocks[k - 1][1].norm, omega, rtol)
            if reason:
                inexact[name] = reason
            for lin in _input_linears(block.sublayer):
                lin.weight.div_(omega)  # (out, in) / (in,): column j scaled by 1/ω_j
    if inexact and not allow_inexact:
        raise ValueError("Admin -> post-norm export is not exact (" + "; ".join(f"{n}: {r}" for n, r in inexact.items())
                         + "); pass allow_inexact=True / --allow-inexact to export an approximation")
    cfg = copy.deepcopy(model.cfg)
    cfg.init = "xavier"
    plain = Seq2SeqTransformer(cfg)
    state = {k: v for k, v in work.state_dict().items() if not k.endswith(".omega")}
    plain.load_state_dict(state)
    plain.train(model.training)
    return plain, {"exact": not inexact, "inexact": inexact}
