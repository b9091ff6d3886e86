"""The schemes up to 2023: post, pre, DeepNorm, Sub-LN, Sandwich, ReZero, ResiDual (formulas in the
package docstring). The registration order is the norm.placement choice order."""
from __future__ import annotations

import math

import torch
from torch import nn

from normlab.model.norms import build_norm
from normlab.model.schemes.base import OWN_CROSS_LAYER, Scheme


class Post(Scheme):
    """x = N(x·ω + drop(F(x))), ω = 1 but with Admin (Liu et al. 2020): a trainable vector of size d
    on the skip branch, created as ones and overwritten by the Admin init routine."""
    name, paper, admin = "post", "Vaswani et al. 2017", True

    def skip(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x * block.omega if block.omega is not None else x

    def forward(self, block, x, *args, **kwargs):
        out = block.sublayer(x, *args, **kwargs)
        return block.norm(block.dropout.add(self.skip(block, x), out))  # one pass on CPU


class Pre(Scheme):
    """x = x + drop(F(N(x))), and a final N per stack."""
    name, paper, pre_like = "pre", "Wang et al. 2019", True

    def forward(self, block, x, *args, **kwargs):
        out = block.sublayer(block.norm(x), *args, **kwargs)
        return block.dropout.add(x, out)  # x + drop(out), one pass on CPU


# N encoder layers, M decoder layers. DeepNorm and Sub-LN scale Xavier-initialised weights of the
# value and output projections of attention and of both FFN layers (never q, k): torchscale
# (microsoft/torchscale, architecture/encoder.py and decoder.py) multiplies or divides the weights
# (and biases, zero here) of `fc1`, `fc2`, `out_proj`, `v_proj` after the default init. The papers'
# pseudo-code uses xavier_normal_(gain); ours is xavier_uniform_ × gain, the same variance.

def deepnorm_constants(n_enc: int, n_dec: int) -> dict[str, tuple[float, float]]:
    """{stack: (α, β)} of DeepNet (Wang et al. 2022, encoder-decoder): encoder α = 0.81·(N⁴M)^(1/16),
    β = 0.87·(N⁴M)^(−1/16); decoder α = (3M)^(1/4), β = (12M)^(−1/4). torchscale divides by
    (N⁴M)^(1/16)/1.15 for the encoder β: 1/1.15 = 0.8696, 0.04% from the paper's 0.87, which we use."""
    nm = (n_enc ** 4 * n_dec) ** (1 / 16)
    return {"encoder": (0.81 * nm, 0.87 / nm), "decoder": ((3 * n_dec) ** 0.25, (12 * n_dec) ** -0.25)}


def subln_gains(n_enc: int, n_dec: int) -> dict[str, float]:
    """{stack: γ} of Sub-LN (Wang et al. 2022, Magneto, encoder-decoder): encoder
    γ = √(log(3M)·log(2N)/3), decoder γ = √(log 3M)."""
    return {"encoder": math.sqrt(math.log(3 * n_dec) * math.log(2 * n_enc) / 3),
            "decoder": math.sqrt(math.log(3 * n_dec))}


class DeepNorm(Post):
    """x = N(α·x + drop(F(x))), α per stack; Xavier × β on v, out, fc1, fc2 (cross-attention too).
    α is a persistent buffer: a pruned model keeps the α it trained with."""
    name, paper, admin, scale_cross = "deepnorm", "Wang et al. 2022, DeepNet", False, True

    def block_options(self, cfg, d, stack, layer):
        return {"alpha": deepnorm_constants(cfg.encoder_layers, cfg.decoder_layers)[stack][0]}

    def add_state(self, block, alpha, **state):
        block.register_buffer("alpha", torch.tensor(float(alpha)))

    def skip(self, block, x):
        return x * block.alpha

    def branch_gains(self, n_enc, n_dec):
        return {stack: beta for stack, (_, beta) in deepnorm_constants(n_enc, n_dec).items()}

    def model_refusal(self, cfg):
        # DeepNet bounds the model update with β on v (and out, fc1, fc2); RMSNorm(β·v) = RMSNorm(v) voids it.
        # (Sub-LN's γ on v is voided by its own inner norm already, so its v_norm is not refused.)
        if cfg.v_norm:
            return ("model.v_norm", "true with norm.placement=deepnorm: DeepNet scales the value projection by β at "
                    "init (Wang et al. 2022), which RMSNorm of the values undoes; leave model.v_norm=false")
        return super().model_refusal(cfg)


class SubLN(Pre):
    """x = x + drop(F(N(x))) as pre-norm, and a final N; F has a norm before its last linear map:
    before the self-attention's output projection and the FFN's fc2; Xavier × γ on v, out, fc1, fc2
    of self-attention and FFN (torchscale's decoder does not scale `encoder_attn`)."""
    name, paper = "subln", "Wang et al. 2022, Magneto"

    def inner_norm(self, norm_cfg, d, kind, bias=True):
        # Self-attention and FFN only: torchscale's MultiheadAttention builds inner_attn_ln `if subln
        # and self.self_attention`, so cross-attention has none.
        return None if kind == "cross" else build_norm(norm_cfg, d, bias)

    def branch_gains(self, n_enc, n_dec):
        return subln_gains(n_enc, n_dec)


class Sandwich(Pre):
    """x = x + N_out(drop(F(N(x)))), and a final N. CogView's code applies the output dropout inside
    the sub-layer, then the third LayerNorm, then the residual add: N_out(drop(F)), as here."""
    name, paper = "sandwich", "Ding et al. 2021, CogView; Kim et al. 2025, Peri-LN"

    def check_block(self, omega, norm_out):
        super().check_block(omega, None)
        if norm_out is None:
            raise ValueError("norm_out is the sandwich placement's second norm (and only its)")

    def block_options(self, cfg, d, stack, layer):
        return {"norm_out": build_norm(cfg.norm, d, cfg.bias)}

    def forward(self, block, x, *args, **kwargs):
        out = block.sublayer(block.norm(x), *args, **kwargs)
        return x + block.norm_out(block.dropout(out))


class ReZero(Scheme):
    """x = x + a·drop(F(x)), a learned scalar, 0 at init; no norm (norm.type=none). The authors'
    code (majumderb/rezero, RZTXEncoderLayer) shares one `resweight` between the sub-layers of a
    layer; here each residual has its own a, the paper's x_{i+1} = x_i + α_i·F(x_i) with a residual
    per sub-layer."""
    name, paper, norm_free = "rezero", "Bachlechner et al. 2020", True

    def add_state(self, block, alpha, **state):
        block.scale = nn.Parameter(torch.zeros(()))

    def forward(self, block, x, *args, **kwargs):
        return x + block.scale * block.dropout(block.sublayer(x, *args, **kwargs))


class DualStreamInput(nn.Module):
    # ResiDual: the dual stream starts as the stack's input (the authors' res = x·1.0).
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack((x, x))  # (2, B, T, D)


class DualStreamOutput(nn.Module):
    # ResiDual: the stack's output x_N + N(d_N) (Xie et al. 2023; the authors' x·1.0 + LN(res)).
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[0] + self.norm(h[1])


class ResiDual(Scheme):
    """(x, d) -> (N(x + f), d + f), f = drop(F(x)); the stack starts with d = x and outputs
    x + N_final(d). The dual stream is carried beside x in one tensor (2, B, T, D), so layers,
    LayerDrop (a skipped layer leaves both streams unchanged) and pruning treat the pair as one
    value; the authors' code (microsoft/ResiDual) passes a tuple (x, res), starts res = x·1.0 and
    ends with x·1.0 + LN(res) (their LayerNorm eps 1e-7; here norm.eps)."""
    name, paper = "resi_dual", "Xie et al. 2023"
    no_dlcl = "ResiDual's dual stream is its own cross-layer connection; choose one"
    # DenseFormer averages one stream of layer outputs (Pagliardini et al. 2024); ResiDual has two
    no_dwa = OWN_CROSS_LAYER

    def forward(self, block, x, *args, **kwargs):
        x, dual = x.unbind(0)  # (B, T, D) each
        out = block.dropout(block.sublayer(x, *args, **kwargs))
        return torch.stack((block.norm(x + out), dual + out))  # (2, B, T, D)

    def stream(self, x):
        return x[0]

    def stream_input(self):
        return DualStreamInput()

    def final_norm(self, norm_cfg, d, bias=True):
        return DualStreamOutput(build_norm(norm_cfg, d, bias))
