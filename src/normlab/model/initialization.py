"""Default initialisation (Vaswani et al. 2017 do not state one; this is fairseq's).

- every nn.Linear: xavier_uniform weight, zero bias. fairseq's attention uses gain 1/√2 on the
  q/k/v projections to mimic one xavier over the fused (3d, d) matrix; we keep gain 1 on each
  separate projection, which is what "xavier on every linear" means.
- every nn.Embedding (token, learned-position, untied output tables): normal(0, d^-0.5) with the
  padding row zeroed, as fairseq's `Embedding()` does, so that embedding × √d has unit scale per
  coordinate.
Norm parameters (LayerNorm/RMSNorm weight 1, bias 0; ScaleNorm g = √d), Admin's ω (ones) and the
FixNorm output g are left at their constructors' values.
Lives in the model package because the model initialises itself on construction; Admin's data-
dependent ω (normlab.init.admin) works on a built model and imports the model, not the reverse.
"""
from __future__ import annotations

import torch
from torch import nn

from normlab.model.schemes import get_scheme

# ModelConfig.init: xavier, or admin (Liu et al. 2020: every post-norm residual gets a trainable ω,
# set before step 1 by normlab.callbacks.admin_init from normlab.init.admin's profiling).
INITS = ("xavier", "admin")


@torch.no_grad()
def xavier_init_(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=module.embedding_dim ** -0.5)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
    return model


# ---- the residual schemes' own initialisation ---------------------------------------------
# DeepNorm's β and Sub-LN's γ (schemes/: Scheme.branch_gains, with the papers' constants) scale
# Xavier-initialised weights of the value and output projections of attention and of both FFN
# layers (never q, k), as torchscale does after its default init.

@torch.no_grad()
def scale_branches_(stack: nn.Module, gain: float, cross: bool) -> None:
    """Multiply v_proj, out_proj (attention) and fc1, fc2 (FFN) weights and biases of every residual
    block of `stack` by `gain`; cross-attention too if `cross` (DeepNet: yes; Sub-LN: torchscale's
    decoder skips `encoder_attn`, and so do we)."""
    for _, block in stack.residual_blocks(""):
        sub = block.sublayer
        if getattr(sub, "kind", None) == "cross" and not cross:
            continue
        names = ("v_proj", "out_proj") if hasattr(sub, "v_proj") else ("fc1", "fc2")
        for name in names:
            lin = getattr(sub, name)
            lin.weight.mul_(gain)
            if lin.bias is not None:
                lin.bias.mul_(gain)


def init_model_(model: nn.Module) -> nn.Module:
    """The model's initialisation: Xavier (above), then the scheme's own scaling and constraint (nGPT's
    unit-norm matrices)."""
    xavier_init_(model)
    cfg = model.cfg
    scheme = get_scheme(cfg.norm.placement)
    gains = scheme.branch_gains(cfg.encoder_layers, cfg.decoder_layers)
    for key, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        if key in gains:
            scale_branches_(stack, gains[key], cross=scheme.scale_cross)
    with torch.no_grad():
        scheme.constrain_(model)
    return model
