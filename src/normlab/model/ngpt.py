"""The normalized Transformer's parts (nGPT, Loshchilov et al. 2025, arXiv 2410.01131), for its
residual scheme (norm.placement=ngpt, schemes/normalized.py), adapted to the encoder-decoder.

The paper's recipe (its §2.6 summary), and where each step lives here:
1. no norm layers (norm.type=none); every hidden state on the unit sphere: the stack input
   h₀ = Norm(√d·e_x + PE) (UnitNorm as the scheme's stream input: our positions are absolute,
   the paper's RoPE, so they are added before the normalisation) and after every sub-layer
   h ← Norm(h + α ⊙ (Norm(F(h)) − h)) (the scheme's forward), no final norm;
2. every matrix normalised along its embedding (d_model) axis after each optimizer step
   (normalize_weights_): rows of W_q, W_k, W_v, of the FFN's first layer and of the embeddings
   (an nn.Linear's weight is (out, in): dim 1); columns of the attention's W_o and the FFN's second
   layer (dim 0), as the authors' code (NVIDIA/ngpt, `normalize_matrices`: justnorm(W, 1) / (W, 0));
3. α per channel, per sub-layer: α_init = 0.05, α_scale = 1/√d_model (ScaledVector);
4. per head q ← s_qk ⊙ Norm(q), k ← s_qk ⊙ Norm(k), softmax scale √d_k instead of 1/√d_k
   (NGPTQKNorm), s_qk of size d_model (every head's channels, the authors' code), init 1, scale 1/√d_model;
5. the FFN's hidden state scaled by s_u (init 1, scale 1; NGPTFeedForward);
6. logits z ← s_z ⊙ z, s_z of size V, init 1, scale 1/√d_model (the output projection's `logit_scale`);
7. no weight decay, no warmup (the scheme refuses others: Scheme.optim_refusal).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model.attention import MultiheadAttention
from normlab.model.dropout import Dropout
from normlab.model.embeddings import OutputProjection, TokenEmbedding
from normlab.model.norms import l2_normalized

ALPHA_INIT = 0.05  # α_{A,init} = α_{M,init} (the paper's §2.6; "of order 1/n_layers")


class ScaledVector(nn.Module):
    # The paper's scale parametrisation (§2.5): a vector s used as s = s_p·(s_init/s_scale), with the
    # trained s_p stored at s_scale: the optimizer's step on s_p is s_init/s_scale times larger on s
    # than a step on a parameter stored at s_init; s starts at s_init.
    def __init__(self, n: int, init: float, scale: float):
        super().__init__()
        self.init, self.scale = init, scale
        self.s = nn.Parameter(torch.full((n,), float(scale)))

    def forward(self) -> torch.Tensor:
        return self.s * (self.init / self.scale)

    def extra_repr(self) -> str:
        return f"n={self.s.numel()}, init={self.init:g}, scale={self.scale:g}"


class UnitNorm(nn.Module):
    # Norm(x) = x/‖x‖ over the last dim, no gain: the paper's Norm (§2.1); fp32 for fp16 / bf16 inputs.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_normalized(x)


class NGPTQKNorm(nn.Module):
    # §2.3.2: q ← s_qk ⊙ Norm(q), k ← s_qk ⊙ Norm(k) per head (Norm over d_k), then the dot product
    # scaled by √d_k (the variance of a dot of unit vectors is 1/d_k; 1/√d_k would shrink the logits
    # further). The attention hands SDPA `sdpa_scale`; keys are cached normalised and scaled.
    def __init__(self, heads: int, head_dim: int, d: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.s_qk = ScaledVector(heads * head_dim, 1.0, d ** -0.5)
        self.sdpa_scale = math.sqrt(head_dim)

    def _scaled(self, t: torch.Tensor) -> torch.Tensor:
        return l2_normalized(t, self.s_qk().view(self.heads, 1, self.head_dim))  # (B, H, T, Dh)

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return self._scaled(q)

    def key(self, k: torch.Tensor) -> torch.Tensor:
        return self._scaled(k)

    def extra_repr(self) -> str:
        return "ngpt: s_qk ⊙ q/‖q‖, s_qk ⊙ k/‖k‖, scale √d_k"


class NGPTFeedForward(nn.Module):
    # §2.4.2 scales the SwiGLU's two inputs, u by s_u and the gate's ν by s_ν·√d_model (so that SiLU
    # sees values of order 1, not the 1/√d of a dot of unit vectors). The FFN here stays every
    # scheme's ReLU FFN (so that a comparison changes the residual stream alone): its one hidden
    # state gets s_u; a positive constant before ReLU (√d_model) is undone by the Norm that follows
    # the FFN (h_M = Norm(FFN(h))), so it is left out. No biases (the paper's projections have none).
    def __init__(self, d: int, ffn: int, activation_dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(d, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, d, bias=False)
        self.s_u = ScaledVector(ffn, 1.0, 1.0)
        self.dropout = Dropout(activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(F.relu(self.s_u() * self.fc1(x))))


def logit_scale(vocab_size: int, d: int) -> ScaledVector:
    # §2.2: z ← s_z ⊙ z with the logits z = E_output·h of unit h and unit rows: cosines, in [-1, 1].
    return ScaledVector(vocab_size, 1.0, d ** -0.5)


def _unit_(weight: torch.Tensor, dim: int) -> None:
    # In place, each slice along `dim` to norm 1; an all-zero slice (the padding embedding) stays 0.
    weight.copy_(F.normalize(weight, dim=dim))


@torch.no_grad()
def normalize_weights_(model: nn.Module) -> None:
    """Every matrix of an nGPT model to unit norm along its embedding axis (module docstring, 2.):
    after the initialisation and after each optimizer step. Other matrices (gated attention's W_θ,
    learned positions) are not the paper's and are left as they are."""
    for module in model.modules():
        if isinstance(module, MultiheadAttention):
            for proj in (module.q_proj, module.k_proj, module.v_proj):
                _unit_(proj.weight, 1)  # (D, in): each row, a dot with the input h
            _unit_(module.out_proj.weight, 0)  # (D, D): each column, a direction in the stream
        elif isinstance(module, NGPTFeedForward):
            _unit_(module.fc1.weight, 1)  # (F, D)
            _unit_(module.fc2.weight, 0)  # (D, F)
        elif isinstance(module, TokenEmbedding):
            _unit_(module.weight, 1)  # (V, D)
        elif isinstance(module, OutputProjection) and module.untied is not None:
            _unit_(module.untied.weight, 1)  # (V, D)
