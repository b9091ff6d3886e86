"""The attention's normalisations of each head's queries and keys (and values), injected into
MultiheadAttention (attention.py) as `qk_norm` or, for HybridNorm, as its scheme's `inner_norm`.

Each has `query(q)` and `key(k)` on (B, H, T, Dh) and `sdpa_scale`, the scale SDPA runs with (None:
its default 1/√d_head); QKVNorm also `value(v)`. model.qk_norm chooses QK-norm (QK_NORMS, build_qk_norm):
ℓ2 (Henry et al. 2020, L2QKNorm) or RMS (OLMo 2, RMSQKNorm); HybridNorm's QKV-norm (Zhuo et al. 2025,
norm.placement=hybrid) is QKVNorm.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from normlab.model.norms import RMSNorm, build_norm, l2_normalized

# model.qk_norm: none, ℓ2 (Henry et al. 2020) or RMS (OLMo 2) normalisation of each head's q and k.
QK_NORMS = ("none", "l2", "rms")


class L2QKNorm(nn.Module):
    # QK-norm (Henry et al. 2020, "Query-Key Normalization for Transformers", Findings of EMNLP;
    # shown on low-resource MT): q̂ = q/‖q‖, k̂ = k/‖k‖ per head, logits g · q̂·k̂ in place of
    # q·k/√d_head, g ONE learned scalar per attention module. The paper initialises
    # g₀ = log₂(L² − L), L the 97.5th percentile of the training sequence lengths
    # (henry_scale_init; model.qk_norm_scale_init sets g₀, null takes L = model.max_positions).
    # g is folded into the queries, so SDPA runs with scale=1: logits = (g·q̂)·k̂. q̂ and g·q̂ are
    # computed in fp32 for fp16 / bf16 inputs and rounded once (norms.l2_normalized): in fp16
    # F.normalize's ε = 1e-12 is 0, so a zero q gave 0/0, and computing in bf16 doubled the error
    # of g·q̂ ≈ 12 (tests/test_qk_norm_precision.py).
    sdpa_scale = 1.0

    def __init__(self, scale_init: float):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(float(scale_init)))

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return l2_normalized(q, self.g)  # (B, H, T, Dh), each row of norm g

    def key(self, k: torch.Tensor) -> torch.Tensor:
        return l2_normalized(k)

    def extra_repr(self) -> str:
        return "l2"


class RMSQKNorm(nn.Module):
    # The common variant (OLMo 2, Team OLMo 2024): RMSNorm of q and of k with learned gains, here over
    # each head's Dh features (one gain vector of size Dh for q, one for k, shared by the heads; OLMo
    # 2 normalises the whole projection before splitting heads), then the usual 1/√d_head scaling.
    sdpa_scale = None  # SDPA's default, 1/√d_head

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return self.q_norm(q)

    def key(self, k: torch.Tensor) -> torch.Tensor:
        return self.k_norm(k)


class QKVNorm(nn.Module):
    # HybridNorm's QKV-norm (Zhuo et al. 2025, arXiv 2503.04598, Fig. 1(d)): softmax(N(Q)N(K)ᵀ/√d_head)N(V),
    # q, k and v each normalised by its own norm of norm.type (build_norm). Per head, over each head's
    # Dh features with one gain vector of size Dh per q, k, v shared by the heads, as the authors' code
    # (BryceZhuo/HybridNorm, dense_model/olmo/model.py: use_query_norm/use_key_norm/use_value_norm
    # build norms of size d_model // n_heads, applied after the split into heads, before the cache).
    # The scheme hands it over as the attention's `inner_norm(norm_cfg, d, kind)` with d = d_model, not
    # knowing the heads: the attention builds the norms, `for_heads(head_dim)`, when it takes it.
    sdpa_scale = None  # SDPA's default, 1/√d_head, as the paper's attention

    def __init__(self, norm_cfg, d: int, bias: bool = True):
        super().__init__()
        self.norm_cfg, self.d, self.norm_bias = norm_cfg, d, bias  # norm_bias: model.bias, for the norms' own

    def for_heads(self, head_dim: int) -> "QKVNorm":
        self.q_norm, self.k_norm, self.v_norm = (build_norm(self.norm_cfg, head_dim, self.norm_bias) for _ in range(3))
        del self.norm_cfg, self.norm_bias
        return self

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return self.q_norm(q)  # (B, H, T, Dh)

    def key(self, k: torch.Tensor) -> torch.Tensor:
        return self.k_norm(k)

    def value(self, v: torch.Tensor) -> torch.Tensor:
        return self.v_norm(v)

    def extra_repr(self) -> str:
        return "q, k, v per head"


def henry_scale_init(length: int) -> float:
    # Henry et al. 2020: g₀ = log₂(L² − L) for sequences of L tokens.
    return math.log2(length * length - length)


def build_qk_norm(kind: str, head_dim: int, scale_init: float | None, eps: float) -> nn.Module | None:
    # kind: model.qk_norm (QK_NORMS); None for none: the module keeps today's path and state dict.
    if kind == "l2":
        return L2QKNorm(scale_init)
    if kind == "rms":
        return RMSQKNorm(head_dim, eps)
    return None
