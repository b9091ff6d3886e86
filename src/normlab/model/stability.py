"""Attention-stability schemes (issue 38): each one a ModelConfig key, off by default, in every self- and
cross-attention of both stacks, with its formula in one class here. s = q·kᵀ/√d_head is an attention
logit, Y the attention's output per head (B, H, T, Dh), X the sub-layer's input (what the attention saw).

model.attn_gate     AttentionGate   Y ⊙ σ(X W_θ), one gate per head or per channel   Qiu et al. 2025
model.attn_sink     AttentionSink   softmax over [s, b_h], the sink's value 0        gpt-oss 2025
model.attn_softcap  softcap         c·tanh(s/c) on the logits                         Gemma 2 2024
model.logit_softcap softcap         c·tanh(z/c) on the vocabulary logits z            Gemma 2 2024
model.k_norm        HeadRMSNorm     RMSNorm(k) per head, q untouched                  x-transformers k_rmsnorm
model.v_norm        HeadRMSNorm     RMSNorm(v) per head                               x-transformers value_rmsnorm

Each acts per position (the gate on its own query, the norms on their own keys and values, the sink
and the cap per logit), so cached step-by-step decoding computes what the full forward does.
SDPA stays the kernel for the gate, the norms and the sink; the logit cap cannot go through it (SDPA
never exposes s) and runs the explicit softmax(c·tanh(s/c)) V below (docs/schemes.md gives its cost).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model.norms import RMSNorm, widened

ATTN_GATES = ("none", "headwise", "elementwise")  # model.attn_gate
# Each key's source, as docs/schemes.md's table row for it cites it (tests/test_attention_stability.py)
PAPERS = {"model.attn_gate": "Qiu et al. 2025, Gated Attention (arXiv 2505.06708",
          "model.attn_sink": "OpenAI 2025, gpt-oss", "model.attn_softcap": "Gemma Team 2024, Gemma 2",
          "model.logit_softcap": "Gemma Team 2024, Gemma 2", "model.k_norm": "x-transformers `k_rmsnorm`",
          "model.v_norm": "x-transformers `value_rmsnorm`"}


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    # Gemma 2 (Gemma Team 2024, arXiv 2408.00118, "logit soft-capping"): logits ← cap·tanh(logits/cap),
    # cap 50 on the attention logits and 30 on the final ones there; x-transformers' softclamp.
    return torch.tanh(x / cap) * cap


class AttentionGate(nn.Module):
    # Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv 2505.06708):
    # the paper's best position G1, Y' = Y ⊙ σ(X W_θ) on the SDPA output Y before the heads are merged
    # and projected, X the input the attention's queries were computed from (the normalised hidden
    # state in a pre-norm layer; in cross-attention the decoder side, never the memory). headwise: one
    # gate per head (W_θ: d → H, shared by the head's Dh channels); elementwise: one per channel (d → H·Dh).
    # No bias, as the formula. W_θ starts at 0, so every gate starts at σ(0) = ½ (our choice: the paper
    # states no init; x-transformers' value gates start at weight 0 with a bias of 10 or 1 in the versions a
    # review read, i.e. gates near 1 or at σ(1), not ½). A plain parameter, not an nn.Linear: the Xavier pass (initialization.py) leaves it
    # at 0 and draws nothing for it, so a gated model has the same other weights, seed for seed.
    paper = "Qiu et al. 2025, Gated Attention (arXiv 2505.06708)"

    def __init__(self, d_in: int, heads: int, head_dim: int, mode: str):
        super().__init__()
        if mode not in ATTN_GATES[1:]:
            raise ValueError(f"attention gate {mode!r}; allowed: {', '.join(ATTN_GATES[1:])}")
        self.mode, self.heads = mode, heads
        self.weight = nn.Parameter(torch.zeros(heads if mode == "headwise" else heads * head_dim, d_in))  # (out, in)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        gate = torch.sigmoid(F.linear(x, self.weight))  # (B, T, H) or (B, T, H·Dh)
        gate = gate.view(B, T, self.heads, -1).transpose(1, 2)  # (B, H, T, 1) or (B, H, T, Dh)
        return y * gate.to(y.dtype)

    def extra_repr(self) -> str:
        return self.mode


class AttentionSink(nn.Module):
    # A learned attention sink (OpenAI 2025, the gpt-oss model card: each attention head has a learned
    # bias in the softmax's denominator): p_j = exp(s_j) / (Σ_i exp(s_i) + exp(b_h)), one
    # logit b_h per head, i.e. softmax over [s, b_h] with the sink's column dropped (its value is 0), so a
    # head can attend to nothing. b starts at 0, as x-transformers' head_learned_sink.
    paper = "OpenAI 2025, gpt-oss (learned attention sinks)"

    def __init__(self, heads: int):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(heads))  # (H,)

    def column(self, rows: int, queries: int, dtype: torch.dtype) -> torch.Tensor:
        return self.logits.to(dtype).view(1, -1, 1, 1).expand(rows, -1, queries, 1)  # (B, H, T, 1)


class HeadRMSNorm(RMSNorm):
    # RMSNorm of each head's keys or values alone, the queries untouched: x-transformers' k_rmsnorm and
    # value_rmsnorm (MultiheadRMSNorm: one gain vector of size Dh per head, init 1; it computes
    # x/max(‖x‖, 1e-12)·√Dh, this x/√(mean(x²) + ε), equal up to ε). An RMSNorm (the optimizer's gains).
    def __init__(self, heads: int, head_dim: int, eps: float):
        super().__init__(head_dim, eps)
        self.weight = nn.Parameter(torch.ones(heads, 1, head_dim))  # broadcasts over (B, H, T, Dh)


class AttentionStability(nn.Module):
    """The stability schemes one attention module uses, each None when off (no state-dict key)."""

    def __init__(self, heads: int, head_dim: int, d_in: int, gate: str = "none", sink: bool = False,
                 logit_cap: float | None = None, k_norm: bool = False, v_norm: bool = False, eps: float = 1e-5):
        super().__init__()
        self.gate = None if gate == "none" else AttentionGate(d_in, heads, head_dim, gate)
        self.sink = AttentionSink(heads) if sink else None
        self.logit_cap = logit_cap
        self.k_norm = HeadRMSNorm(heads, head_dim, eps) if k_norm else None
        self.v_norm = HeadRMSNorm(heads, head_dim, eps) if v_norm else None

    def key(self, k: torch.Tensor) -> torch.Tensor:
        return k if self.k_norm is None else self.k_norm(k)  # (B, H, S, Dh)

    def value(self, v: torch.Tensor) -> torch.Tensor:
        return v if self.v_norm is None else self.v_norm(v)

    def gated(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y if self.gate is None else self.gate(x, y)

    def attend(self, q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None) -> torch.Tensor:
        # F.scaled_dot_product_attention's contract; attn_mask boolean (True = attend), broadcastable
        # to (B, H, Tq, S).
        if self.logit_cap is not None:
            return explicit_attention(q, k, v, attn_mask, is_causal, dropout_p, scale, self.logit_cap, self.sink)
        if self.sink is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                  dropout_p=dropout_p, scale=scale)
        # The sink through SDPA: one more key and value, both 0, so its logit q·0 = 0 plus the mask's
        # additive bias b_h is the sink's logit and its value adds nothing. The mask becomes a float
        # (B, H, Tq, S + 1) tensor: flash attention takes no mask, so SDPA uses its memory-efficient
        # kernel (CUDA) and the causal kernel is not used.
        B, H, Tq, S = q.size(0), q.size(1), q.size(2), k.size(2)
        zero = k.new_zeros(k.size(0), H, 1, k.size(3))
        bias = torch.cat([additive_mask(attn_mask, is_causal, B, H, Tq, S, q.dtype, q.device),
                          self.sink.column(B, Tq, q.dtype)], dim=-1)  # (B, H, Tq, S + 1)
        return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, v.new_zeros(zero.shape)], 2),
                                              attn_mask=bias, dropout_p=dropout_p, scale=scale)

    def extra_repr(self) -> str:
        return "" if self.logit_cap is None else f"logit_cap={self.logit_cap:g}"


def additive_mask(mask, is_causal: bool, B: int, H: int, Tq: int, S: int, dtype, device) -> torch.Tensor:
    # The boolean mask (True = attend) as 0 / -inf, expanded to (B, H, Tq, S).
    if is_causal:
        mask = torch.ones(Tq, S, dtype=torch.bool, device=device).tril()
    bias = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf"))
    return bias.expand(B, H, Tq, S)


def explicit_attention(q, k, v, attn_mask, is_causal, dropout_p, scale, cap, sink) -> torch.Tensor:
    # softmax(c·tanh(s/c)) V, the sink (if any) as one more logit column, uncapped (b_h is a learned
    # logit, not a dot product; gpt-oss has no cap, Gemma 2 no sink). Materialises the (B, H, Tq, S)
    # logits, as x-transformers' Attend does for softclamp_logits (its flash path refuses the cap).
    # Logits, cap and softmax in at least fp32, rounded to v's dtype for the product with V.
    _, p = attention_weights(q, k, attn_mask, is_causal, scale, cap, sink)
    if dropout_p > 0.0:
        p = F.dropout(p, dropout_p)
    return p.to(v.dtype) @ v  # (B, H, Tq, Dh)


def attention_weights(q, k, attn_mask, is_causal, scale, cap=None, sink=None) -> tuple[torch.Tensor, torch.Tensor]:
    # The logits s = q·kᵀ·scale (before the cap; -inf where the mask hides a key) and the probabilities
    # softmax over [cap(s), sink] without the sink's column, both (B, H, Tq, S), in at least fp32: what
    # SDPA (or explicit_attention) computes without handing them out. cap None: no cap; sink None: none.
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    with torch.autocast(q.device.type, enabled=False):  # fp32 logits as SDPA's kernels keep them (autocast
        s = widened(q) @ widened(k).transpose(-2, -1) * scale  # would form the product in bf16): (B, H, Tq, S)
    B, H, Tq, S = s.shape
    z = s if cap is None else softcap(s, cap)
    if is_causal or attn_mask is not None:
        bias = additive_mask(attn_mask, is_causal, B, H, Tq, S, s.dtype, s.device)
        s, z = s + bias, z + bias
    if sink is not None:
        z = torch.cat([z, sink.column(B, Tq, z.dtype)], dim=-1)  # (B, H, Tq, S + 1)
    return s, torch.softmax(z, dim=-1)[..., :S]  # without the sink's column: its value is 0


def build_stability(cfg, heads: int, head_dim: int, d_in: int) -> AttentionStability | None:
    # cfg: a ModelConfig. None when every scheme is off: the attention and its state dict are today's.
    if (cfg.attn_gate, cfg.attn_sink, cfg.attn_softcap, cfg.k_norm, cfg.v_norm) == ("none", False, None, False, False):
        return None
    return AttentionStability(heads, head_dim, d_in, cfg.attn_gate, cfg.attn_sink, cfg.attn_softcap, cfg.k_norm,
                              cfg.v_norm, cfg.norm.eps)
