"""Encoder-decoder Transformer (Vaswani et al. 2017) built from a ModelConfig alone.

Norm type and placement are injected through ResidualBlock (residual.py) and its scheme
(schemes/); layers sit in an `nn.ModuleList` called `layers`, run by the stack's `aggregation`
(aggregation.py: one after the other, DLCL or DenseFormer's DWA) with `for layer in layers`, so
LayerDrop (Fan et al. 2019) can swap in a ModuleList whose iterator skips layers without touching
the loops. A stack is:
embed -> stream_in (identity, ResiDual's second stream, or hyper-connections' n streams) -> layers
-> stream_out (hyper-connections: the streams' sum) -> final_norm (the scheme's).
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from typing import TYPE_CHECKING

from normlab.model.attention import FirstValues, IncrementalCache, MultiheadAttention, ValueResidual
from normlab.model.qk_norms import build_qk_norm, henry_scale_init
from normlab.model.dropout import Dropout
from normlab.model.embeddings import (InputEmbedding, LearnedPositions, OutputProjection,
                                      SinusoidalPositions, TokenEmbedding)
from normlab.model.aggregation import build_aggregation
from normlab.model.hyper import build_connection, stream_ends
from normlab.model.initialization import init_model_
from normlab.model.norms import ScaleNorm, build_norm
from normlab.model.residual import ResidualBlock
from normlab.model.schemes import get_scheme
from normlab.model.stability import build_stability
from normlab.regularizers.drophead import DropHead
from normlab.regularizers.layerdrop import layer_list

if TYPE_CHECKING:  # config.py imports its choice lists from the model package
    from normlab.config import ModelConfig


class FeedForward(nn.Module):
    # FFN(x) = max(0, xW1 + b1)W2 + b2 (Vaswani et al. 3.3); dropout on the hidden ReLU output is
    # fairseq's activation_dropout (the authors of Transformers without Tears use it too).
    # `inner_norm` (Sub-LN, Wang et al. 2022) acts on the hidden layer before fc2; identity otherwise.
    # fc1 and fc2 keep b1 and b2 under model.bias=false, which removes the attention projections' and
    # the norms' biases only: x-transformers' default too (attn_*_bias off, ff_no_bias off).
    def __init__(self, d: int, ffn: int, activation_dropout: float, inner_norm: nn.Module | None = None):
        super().__init__()
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)
        self.dropout = Dropout(activation_dropout)
        self.inner_norm = inner_norm if inner_norm is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.inner_norm(self.dropout(F.relu(self.fc1(x)))))


def _residual(cfg: ModelConfig, sublayer: nn.Module, d: int, stack: str, layer: int, block: int) -> ResidualBlock:
    # Admin (Liu et al. 2020) adds a trainable ω to every residual branch; the scheme adds what it
    # needs (DeepNorm its α, Sandwich a second norm on the branch output, what layer `layer` needs);
    # hyper-connections their weights, which start from the block's index in the stack (`block`).
    scheme = get_scheme(cfg.norm.placement)
    return ResidualBlock(sublayer, build_norm(cfg.norm, d, cfg.bias), d, scheme.name, cfg.dropout,
                         omega=cfg.init == "admin", hyper=build_connection(cfg, d, block),
                         **scheme.block_options(cfg, d, stack, layer))


def _inner_norm(cfg: ModelConfig, d: int, kind: str) -> nn.Module | None:
    # A norm inside the sub-layer, before its last linear map (Sub-LN, Wang et al. 2022), if any.
    return get_scheme(cfg.norm.placement).inner_norm(cfg.norm, d, kind, cfg.bias)


def _attention(cfg: ModelConfig, d: int, heads: int, kind: str, memory_dim: int | None = None) -> MultiheadAttention:
    # Scheduled DropHead (Zhou et al. 2020) on the attention kinds switched on; its rate is set
    # every step by the schedule callback. p = 0: no module at all (nn.Identity).
    reg = cfg.regularizer
    drophead = DropHead(reg.drophead) if reg.drophead > 0 and getattr(reg, f"drophead_{kind}") else None
    # QK-norm in every attention, self and cross, of both stacks (Henry et al. 2020 normalise all).
    g0 = (cfg.qk_norm_scale_init if cfg.qk_norm_scale_init is not None
          else henry_scale_init(cfg.max_positions) if cfg.qk_norm == "l2" else None)  # only l2 has a scale
    # nGPT (norm.placement=ngpt) brings its own: s_qk ⊙ q/‖q‖ per head, scale √d_k (model/ngpt.py)
    qk_norm = (get_scheme(cfg.norm.placement).qk_norm(heads, d // heads, d)
               or build_qk_norm(cfg.qk_norm, d // heads, g0, cfg.norm.eps))
    # Value residual (Zhou et al. 2024) in the self-attention of every layer of both stacks.
    value_residual = ValueResidual() if cfg.value_residual and kind != "cross" else None
    # The attention-stability schemes (model/stability.py), in self- and cross-attention alike.
    return MultiheadAttention(d, heads, cfg.attention_dropout, kdim=memory_dim, vdim=memory_dim, kind=kind,
                              drophead=drophead, inner_norm=_inner_norm(cfg, d, kind), qk_norm=qk_norm,
                              value_residual=value_residual, bias=cfg.bias,
                              stability=build_stability(cfg, heads, d // heads, d))


def _ffn(cfg: ModelConfig, d: int, ffn: int) -> nn.Module:
    own = get_scheme(cfg.norm.placement).feed_forward(d, ffn, cfg.activation_dropout)  # nGPT's scaled FFN
    return own if own is not None else FeedForward(d, ffn, cfg.activation_dropout, _inner_norm(cfg, ffn, "ffn"))


# A layer hands its input to its last block (layer_input): B2T's bottom-to-top skip uses it, every
# other scheme ignores it. `index`: the layer's 0-based position in its stack at construction.
class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, d: int, heads: int, ffn: int, index: int = 0):
        super().__init__()
        self.self_attn = _residual(cfg, _attention(cfg, d, heads, "encoder_self"), d, "encoder", index, 2 * index)
        self.ffn = _residual(cfg, _ffn(cfg, d, ffn), d, "encoder", index, 2 * index + 1)

    def forward(self, x: torch.Tensor, src_pad_mask: torch.Tensor, values: FirstValues | None = None) -> torch.Tensor:
        h = self.self_attn(x, key_padding_mask=src_pad_mask, values=values)
        return self.ffn(h, layer_input=x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, d: int, heads: int, ffn: int, memory_dim: int, index: int = 0):
        super().__init__()
        self.self_attn = _residual(cfg, _attention(cfg, d, heads, "decoder_self"), d, "decoder", index, 3 * index)
        # Queries come from the decoder, keys and values from the encoder output (Vaswani 3.2.3).
        self.cross_attn = _residual(cfg, _attention(cfg, d, heads, "cross", memory_dim), d, "decoder", index,
                                    3 * index + 1)
        self.ffn = _residual(cfg, _ffn(cfg, d, ffn), d, "decoder", index, 3 * index + 2)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor,
                cache: IncrementalCache | None = None, values: FirstValues | None = None) -> torch.Tensor:
        h = self.self_attn(x, causal=True, cache=cache, values=values)
        h = self.cross_attn(h, memory, key_padding_mask=src_pad_mask, cache=cache)
        return self.ffn(h, layer_input=x)


def _positions(cfg: ModelConfig, d: int) -> nn.Module:
    cls = LearnedPositions if cfg.learned_positions else SinusoidalPositions
    return cls(cfg.max_positions, d)


class _Stack(nn.Module):
    def first_values(self) -> dict:
        # The value residual's V₁ travels from the first self-attention that runs to the later ones
        # in an object new at every forward, passed down to the layers as `values=` (aggregation,
        # LayerDrop and the residual blocks hand keyword arguments on untouched).
        return {"values": FirstValues()} if self.value_residual else {}

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        # The stack's one output stream: hyper-connections' streams summed, else x itself.
        return x if self.stream_out is None else self.stream_out(x)

    def residual_blocks(self, prefix: str) -> list[tuple[str, ResidualBlock]]:
        """[(name, block)] in forward order, names like enc.3.ffn. By index, not by iterating the
        layers: LayerDrop's list skips layers (and draws) when iterated in training."""
        return [(f"{prefix}.{i}.{name}", child) for i in range(len(self.layers))
                for name, child in self.layers[i].named_children() if isinstance(child, ResidualBlock)]


class Encoder(_Stack):
    def __init__(self, cfg: ModelConfig, tokens: TokenEmbedding):
        super().__init__()
        d = cfg.d_model
        self.pad_id = cfg.pad_id
        self.value_residual = cfg.value_residual
        self.embed = InputEmbedding(tokens, _positions(cfg, d), cfg.dropout)
        # hyper-connections: n copies in, their sum out (model/hyper.py); else stream_out is None
        self.stream_in, self.stream_out = stream_ends(cfg, get_scheme(cfg.norm.placement).stream_input())
        reg = cfg.regularizer  # LayerDrop: a ModuleList whose iterator skips layers in training
        self.layers = layer_list((EncoderLayer(cfg, d, cfg.encoder_heads, cfg.encoder_ffn, i)
                                  for i in range(cfg.encoder_layers)), reg.encoder_layerdrop,
                                 reg.layerdrop_rates, salt=1)
        self.aggregation = build_aggregation(cfg, "encoder", cfg.encoder_layers, d)
        self.final_norm = get_scheme(cfg.norm.placement).final_norm(cfg.norm, d, cfg.bias)

    def forward(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src_pad_mask = src.eq(self.pad_id)  # (B, S), True = pad
        x = self.stream_in(self.embed(src))  # (B, S, D); ResiDual: (2, B, S, D)
        x = self.aggregation(self.layers, x, src_pad_mask, **self.first_values())
        return self.final_norm(self.reduce(x)), src_pad_mask


class Decoder(_Stack):
    def __init__(self, cfg: ModelConfig, tokens: TokenEmbedding):
        super().__init__()
        d = cfg.decoder_d_model
        self.value_residual = cfg.value_residual
        self.embed = InputEmbedding(tokens, _positions(cfg, d), cfg.dropout)
        # hyper-connections: n copies in, their sum out (model/hyper.py); else stream_out is None
        self.stream_in, self.stream_out = stream_ends(cfg, get_scheme(cfg.norm.placement).stream_input())
        reg = cfg.regularizer
        self.layers = layer_list((DecoderLayer(cfg, d, cfg.decoder_heads, cfg.decoder_ffn, cfg.d_model, i)
                                  for i in range(cfg.decoder_layers)), reg.decoder_layerdrop,
                                 reg.layerdrop_rates, salt=2)
        self.aggregation = build_aggregation(cfg, "decoder", cfg.decoder_layers, d)
        self.final_norm = get_scheme(cfg.norm.placement).final_norm(cfg.norm, d, cfg.bias)

    def forward(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor,
                cache: IncrementalCache | None = None) -> torch.Tensor:
        # Target padding needs no mask: pads sit after the real tokens and the causal mask already
        # hides later positions; outputs at pad positions are ignored by the loss.
        offset = 0 if cache is None else cache.length
        x = self.stream_in(self.embed(tgt_in, offset))  # (B, T, D_dec); ResiDual: (2, B, T, D_dec)
        x = self.aggregation(self.layers, x, memory, src_pad_mask, cache, **self.first_values())
        if cache is not None:
            cache.length += tgt_in.size(1)
        return self.final_norm(self.reduce(x))


def _fixnorm_scale_moved(module, state_dict, prefix, *args) -> None:
    # Checkpoints written before the FixNorm output scale moved to the decoder's final ScaleNorm kept
    # it in output_projection.g (and a final g without effect): the old logits g·cos(x, w) are the
    # new ones with that g as the final norm's, so the value moves over exactly.
    old, new = prefix + "output_projection.g", prefix + "decoder.final_norm.g"
    if old in state_dict and module.output_projection.g is None:
        state_dict[new] = state_dict.pop(old)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        V, fixnorm = cfg.vocab_size, cfg.norm.fixnorm
        enc_tokens = TokenEmbedding(V, cfg.d_model, cfg.pad_id, fixnorm)
        dec_tokens = (enc_tokens if cfg.share_embeddings
                      else TokenEmbedding(V, cfg.decoder_d_model, cfg.pad_id, fixnorm))
        self.encoder = Encoder(cfg, enc_tokens)
        self.decoder = Decoder(cfg, dec_tokens)
        tied = dec_tokens if cfg.tie_output_embeddings else None
        # FixNorm: a decoder that ends in a ScaleNorm hands over g·x/‖x‖, whose g is the output scale.
        scaled = isinstance(self.decoder.final_norm, ScaleNorm)
        self.output_projection = OutputProjection(V, cfg.decoder_d_model, tied, fixnorm, scaled_input=scaled,
                                                  softcap=cfg.logit_softcap,
                                                  logit_scale=get_scheme(cfg.norm.placement).logit_scale(
                                                      V, cfg.decoder_d_model))
        init_model_(self)
        self.register_load_state_dict_pre_hook(_fixnorm_scale_moved)  # hook(module, state_dict, prefix, ...)

    @classmethod
    def from_config_dict(cls, d: Mapping) -> "Seq2SeqTransformer":
        from normlab.config import ModelConfig

        return cls(ModelConfig.from_dict(d))

    # ---- structure: how other code (Admin, diagnostics, probes) learns the model's blocks ------
    def stacks(self) -> dict[str, _Stack]:
        return {"enc": self.encoder, "dec": self.decoder}

    def residual_blocks(self) -> list[tuple[str, ResidualBlock]]:
        """Every residual block, encoder then decoder, in forward order; consumes no LayerDrop draw."""
        return [nb for key, stack in self.stacks().items() for nb in stack.residual_blocks(key)]

    @torch.no_grad()
    def constrain_(self) -> None:
        """What the scheme keeps true of the weights (nGPT: unit-norm matrices), restored after every
        optimizer step (lit_module.optimizer_step) as after the initialisation; nothing for the others."""
        get_scheme(self.cfg.norm.placement).constrain_(self)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, project: bool = True) -> torch.Tensor:
        # project=False: the decoder's output states (B, T, D), for a loss that applies the output
        # projection itself (losses.model_loss: no (B, T, V) logits in training).
        memory, src_pad_mask = self.encode(src)
        if not project:
            return self.decoder(tgt_in, memory, src_pad_mask)
        return self.decode(tgt_in, memory, src_pad_mask)  # (B, T, V)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(src)  # (B, S, D), (B, S) bool True = pad

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor,
               cache: IncrementalCache | None = None) -> torch.Tensor:
        # With a cache, tgt_in holds only the new step(s); keys/values of the prefix come from it.
        return self.output_projection(self.decoder(tgt_in, memory, src_pad_mask, cache))  # (B, T, V)

    def new_cache(self) -> IncrementalCache:
        return IncrementalCache()

    def num_parameters(self, trainable_only: bool = False) -> int:
        # parameters() yields each shared (tied) tensor once.
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
