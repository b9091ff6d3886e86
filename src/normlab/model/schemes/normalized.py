"""The normalized Transformer, nGPT (Loshchilov et al. 2025, arXiv 2410.01131), as norm.placement=ngpt:
every hidden state on the unit sphere, each sub-layer a step towards its normalised output (model/ngpt.py
has its parts and the paper's recipe step by step).

Encoder-decoder adaptation (the paper is decoder-only): both stacks are normalized Transformers. The
encoder's output, on the sphere already, is the memory (no final norm); in the decoder the
cross-attention is one more sub-layer with its own α_C, h ← Norm(h + α_C ⊙ (Norm(CrossAttn(h, m)) − h)),
its queries from h and keys and values from the memory m, normalised per head and scaled by its s_qk
as in self-attention, and its W_k, W_v normalised along their input (the memory's width) like W_q:
every input an attention reads is a unit vector, so the same reasoning (logits are cosines, scaled by
s_qk² and √d_k) holds for it. The residual dropout acts on F(h) before its Norm.
"""
from __future__ import annotations

import torch
from torch import nn

from normlab.model import ngpt
from normlab.model.norms import l2_normalized
from normlab.model.schemes.base import Scheme


class NGPT(Scheme):
    """x = Norm(x + α ⊙ (Norm(drop(F(x))) − x)), Norm(x) = x/‖x‖, α per channel per sub-layer; the
    stack starts with Norm(embedding) and has no final norm."""
    name, paper, norm_free = "ngpt", "Loshchilov et al. 2025, nGPT", True
    final_n = False  # h is a unit vector after every block
    constrained = True  # unit-norm matrices (constrain_)
    no_dlcl = no_dwa = ("nGPT keeps every hidden state on the unit sphere; a learned mix of the layers' outputs "
                        "is not on it; choose one")

    def block_options(self, cfg, d, stack, layer):
        return {"width": d}

    def add_state(self, block, alpha, width=None, **state):
        # α_init 0.05, α_scale 1/√d_model (the paper's §2.6), stored as the block's `ngpt_alpha`
        block.ngpt_alpha = ngpt.ScaledVector(width, ngpt.ALPHA_INIT, width ** -0.5)

    def forward(self, block, x, *args, **kwargs):
        h = l2_normalized(block.dropout(block.sublayer(x, *args, **kwargs)))  # Norm(F(h))
        return l2_normalized(x + block.ngpt_alpha() * (h - x))

    def stream_input(self) -> nn.Module:
        return ngpt.UnitNorm()  # h₀ = Norm(√d·e_x + PE)

    def qk_norm(self, heads, head_dim, d):
        return ngpt.NGPTQKNorm(heads, head_dim, d)

    def feed_forward(self, d, ffn, activation_dropout):
        return ngpt.NGPTFeedForward(d, ffn, activation_dropout)

    def logit_scale(self, vocab_size, d):
        return ngpt.logit_scale(vocab_size, d)

    def constrain_(self, model: nn.Module) -> None:
        ngpt.normalize_weights_(model)

    # ---- refused: what nGPT replaces or rules out, each with one line ----------------------------
    def norm_refusal(self, norm):
        if norm.type != "none":
            return ("norm.type", f"{norm.type} with norm.placement=ngpt: nGPT removes every norm layer and "
                    "normalises onto the unit sphere itself (Loshchilov et al. 2025); set norm.type=none (norm=ngpt)")
        if norm.fixnorm:
            return ("norm.fixnorm", "true with norm.placement=ngpt: nGPT normalises the embeddings and the output "
                    "layer itself (Loshchilov et al. 2025); set norm.fixnorm=false")
        return super().norm_refusal(norm)

    def model_refusal(self, cfg):
        if cfg.bias:
            return ("model.bias", "true with norm.placement=ngpt: nGPT's projections have no biases "
                    "(Loshchilov et al. 2025); set model.bias=false (+arm=ngpt does)")
        for key in ("qk_norm", "k_norm", "v_norm"):
            if getattr(cfg, key) not in ("none", False):
                return (f"model.{key}", f"{getattr(cfg, key)} with norm.placement=ngpt: nGPT normalises each "
                        "head's queries and keys itself (s_qk·q/‖q‖, s_qk·k/‖k‖); leave it off")
        return super().model_refusal(cfg)

    def optim_warnings(self, optim):
        # Applied and warned, not refused: a study screens each arm's warmup (design: a verdict is about
        # the scheme, not one regime), and a refusal would keep nGPT out of any shared grid. The arm
        # (+arm=ngpt) sets both to 0, the paper's recipe.
        lines = []
        if optim.warmup and optim.schedule != "inverse_sqrt_hold":  # hold: `warmup` steps at the peak, no ramp
            lines.append(f"optim.warmup={optim.warmup} with norm.placement=ngpt: the paper trains nGPT without "
                         "learning-rate warmup (Loshchilov et al. 2025, §2.6); applied as set")
        if optim.weight_decay:
            lines.append(f"optim.weight_decay={optim.weight_decay} with norm.placement=ngpt: the paper trains nGPT "
                         "without weight decay (§2.6), and the renormalisation after each step undoes a decay of "
                         "the matrices; applied as set")
        return lines
