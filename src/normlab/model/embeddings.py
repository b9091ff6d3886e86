"""Token embeddings, positional encodings and the (tied) output projection.

Vaswani et al. 2017 (3.4, 3.5): embeddings × √d, sinusoidal positions added, dropout on the sum
(5.4); the output projection shares the embedding matrix.
FixNorm (Nguyen & Salazar 2019): embeddings are l2-normalised; the authors' code
(transformers_without_tears, model.py: `F.normalize(word_embedding) ... * self.scale`) then
multiplies by √d like ordinary embeddings, and so do we, so the input scale matches the
un-normalised case (‖e‖ = √d) and the positional encodings are not drowned out or drowning.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model.dropout import Dropout
from normlab.model.norms import l2_normalized
from normlab.model.stability import softcap


def sinusoidal_table(max_positions: int, d: int) -> torch.Tensor:
    # The paper's convention, interleaved: PE(pos, 2i) = sin(pos / 10000^(2i/d)),
    # PE(pos, 2i+1) = cos(pos / 10000^(2i/d)). (fairseq and tensor2tensor concatenate a sin half
    # and a cos half instead: a fixed permutation of dimensions, so weights do not transfer.)
    pos = torch.arange(max_positions, dtype=torch.float64)[:, None]  # (P, 1)
    two_i = torch.arange(0, d, 2, dtype=torch.float64)  # (ceil(d/2),)
    angle = pos / torch.pow(10000.0, two_i / d)  # (P, ceil(d/2))
    table = torch.zeros(max_positions, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d // 2])
    return table.float()


class SinusoidalPositions(nn.Module):
    def __init__(self, max_positions: int, d: int):
        super().__init__()
        # Not persistent: a checkpoint need not carry a table the config recomputes exactly.
        self.register_buffer("table", sinusoidal_table(max_positions, d), persistent=False)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        _check_positions(offset + length, self.table.size(0))
        return self.table[offset: offset + length]  # (T, D)


class LearnedPositions(nn.Module):
    def __init__(self, max_positions: int, d: int):
        super().__init__()
        self.embedding = nn.Embedding(max_positions, d)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        _check_positions(offset + length, self.embedding.num_embeddings)
        return self.embedding.weight[offset: offset + length]  # (T, D)


def _check_positions(needed: int, available: int) -> None:
    if needed > available:
        raise ValueError(f"sequence needs {needed} positions but model.max_positions={available}")


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, d: int, pad_id: int, fixnorm: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d, padding_idx=pad_id)
        self.fixnorm = fixnorm
        self.scale = math.sqrt(d)

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embedding(tokens)  # (B, T, D)
        if self.fixnorm:  # the pad row is zero and stays zero (in fp32: in fp16 it was 0/0, l2_normalized)
            return l2_normalized(e, self.scale)
        return e * self.scale


class InputEmbedding(nn.Module):
    # tokens -> dropout(token embedding + position), positions offset by the decoded prefix length.
    def __init__(self, tokens: TokenEmbedding, positions: nn.Module, dropout: float):
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.dropout = Dropout(dropout)

    def forward(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return self.dropout(self.tokens(tokens) + self.positions(tokens.size(1), offset))


class OutputProjection(nn.Module):
    # Tied (Press & Wolf 2017; Vaswani et al. 3.4): logits = x @ Eᵀ with E the decoder's embedding
    # matrix. Untied: a (V, D) table of its own, initialised like an embedding (fairseq).
    # FixNorm (Nguyen & Salazar 2019): logits = g · (w·x) / (‖w‖‖x‖) with a learned scalar g,
    # initialised to √d. In the authors' code g is the g of the final ScaleNorm of their pre-norm
    # decoder (ScaleNorm(embed_dim ** 0.5)) applied before x @ normalize(E)ᵀ. So with
    # `scaled_input` (the decoder ends in a ScaleNorm: x = g·x̂/‖x̂‖ already) the logits are
    # x @ normalize(E)ᵀ and that norm's g is the output scale, as the authors'; normalising x again
    # would leave that g without gradient. Otherwise (post-norm, other norm types, ResiDual's
    # output) this module normalises x and owns g: the same function.
    # softcap (model.logit_softcap; Gemma 2): logits c·tanh(z/c), here for decoding and in the chunked
    # loss (losses.model_loss reads it), so training, validation and decoding score the same logits.
    # logit_scale (nGPT's s_z, Loshchilov et al. 2025): a module whose output s (V,) scales the logits,
    # s ⊙ z, folded into the rows of W (z_v = h·(s_v w_v)), so the chunked loss sees it too.
    def __init__(self, vocab_size: int, d: int, tied: TokenEmbedding | None, fixnorm: bool = False,
                 scaled_input: bool = False, softcap: float | None = None, logit_scale: nn.Module | None = None):
        super().__init__()
        self.tied = tied
        self.untied = None if tied is not None else nn.Embedding(vocab_size, d)
        self.fixnorm = fixnorm
        self.g = nn.Parameter(torch.tensor(math.sqrt(d))) if fixnorm and not scaled_input else None
        self.softcap = softcap
        self.logit_scale = logit_scale  # None: no module, no state-dict key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(*self.operands(x))  # (B, T, V)
        return logits if self.softcap is None else softcap(logits, self.softcap)

    def operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (x', W') with logits = x' W'ᵀ, so the training loss can take the product in row chunks
        # (losses.projected_label_smoothed_nll) without materialising the (B, T, V) logits.
        weight = self.tied.weight if self.tied is not None else self.untied.weight  # (V, D)
        if self.logit_scale is not None:
            weight = self.logit_scale().unsqueeze(1) * weight  # (V, 1) x (V, D)
        if not self.fixnorm:
            return x, weight
        if self.g is None:
            return x, l2_normalized(weight)  # x = g·x̂/‖x̂‖ from the final ScaleNorm
        return l2_normalized(x, self.g), l2_normalized(weight)
