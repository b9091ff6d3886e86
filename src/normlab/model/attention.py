"""Multi-head attention over `F.scaled_dot_product_attention`, with a KV cache and injected modules.

Attention(Q, K, V) = softmax(QKᵀ/√d_k) V (Vaswani et al. 2017, 3.2.1); SDPA computes exactly
that with its default scale 1/√d_k and picks a fused kernel, so there is no slow path in training.
Projections are separate q/k/v/out `nn.Linear`s with bias so `torch.nn.MultiheadAttention`
weights copy in (its in_proj_weight rows are [q; k; v]), or without one (`bias=False`, model.bias=false:
x-transformers' default, as PaLM and LLaMA); kdim/vdim let the decoder attend to an
encoder of another width. Self-attention runs q, k and v as one matmul, cross-attention k and v
of the memory (`_fused`).
Optional behaviour is injected as modules that default to nn.Identity (torchtune's pattern):
`drophead` acts on the per-head outputs (B, H, T, Dh) (Scheduled DropHead, Zhou et al. 2020:
normlab.regularizers.drophead), `inner_norm` on the merged heads (B, T, D) before the output
projection (Sub-LN, Wang et al. 2022), `qk_norm` on the per-head queries and keys (QK-norm, Henry
et al. 2020; model.qk_norm, see L2QKNorm and RMSQKNorm in qk_norms.py), `value_residual` on a
self-attention's values (Zhou et al. 2024; model.value_residual, see ValueResidual). HybridNorm's QKV-norm
(Zhuo et al. 2025; norm.placement=hybrid, see QKVNorm in qk_norms.py) reaches the module as its scheme's
`inner_norm` and acts on the per-head queries, keys and values instead of the merged heads. `stability`
holds the attention-stability schemes (gated attention, a learned sink, logit soft-capping, key / value
RMSNorm; model/stability.py), None when all are off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model.qk_norms import QKVNorm
from normlab.model.stability import AttentionStability, attention_weights
from normlab.private_api import tensor_version

# kind of each attention module: the model injects DropHead by kind (RegularizerConfig's
# drophead_encoder_self / drophead_decoder_self / drophead_cross), Admin's export needs to know
# which projections read the residual stream (a cross-attention's keys and values read memory).
KINDS = ("encoder_self", "decoder_self", "cross")


class IncrementalCache:
    # Keys/values of every attention module for step-by-step decoding, keyed by the module itself,
    # plus `length`: target positions already decoded (the positional offset of the next step).
    # Self-attention states have one row per hypothesis; cross-attention states one row per source
    # sentence (they depend only on the source), shared by all of its hypotheses (see forward).
    def __init__(self):
        self.length = 0
        self._states: dict[nn.Module, dict[str, torch.Tensor]] = {}
        self._sources: dict[nn.Module, dict[str, torch.Tensor]] = {}

    def state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return self._states.setdefault(module, {})

    def source_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return self._sources.setdefault(module, {})

    def reorder(self, rows: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        # Beam search reorders hypotheses (and greedy drops finished rows) along the batch dimension:
        # `rows` indexes the hypotheses. `sources` indexes the source sentences when those change
        # (sentences leave the batch); beams moving within a sentence copy no cross-attention state.
        for states, index in ((self._states, rows), (self._sources, sources)):
            if index is None:
                continue
            for state in states.values():
                for key, value in state.items():
                    state[key] = value.index_select(0, index)


def shape_free_sdpa(device: torch.device | str) -> bool:
    """On CUDA, leave cuDNN out of the backends F.scaled_dot_product_attention may pick (process-wide,
    torch.backends.cuda.enable_cudnn_sdp); True when it did. cuDNN's attention builds an execution plan
    for every new input shape, and translation's token-bucketed batches and decoding steps change shape
    almost every call. Measured on an H100 (torch 2.11.0+cu130, 2026-11-27; benchmarks/README.md, GPU
    check): make train's model over 60 corpus batches (53 shapes) ran a median 413 ms a step with cuDNN
    allowed, 22 ms without (the flash / memory-efficient kernels, which need no plan); train.py
    trainer=gpu 278 -> 27 ms a step. Fixed-shape batches (the peers' benchmark) never showed it."""
    if torch.device(device).type != "cuda":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


class FirstValues:
    # The values V₁ of the first self-attention that runs in one forward of a stack, handed to the
    # later ones (ValueResidual). The stack makes a new one per forward (a decoding step is a forward:
    # it holds that step's V₁), so nothing outlives the forward, and passes it down as `values=`.
    def __init__(self):
        self.v: torch.Tensor | None = None  # (B, H, T, Dh)


class ValueResidual(nn.Module):
    # Value residual learning (Zhou et al. 2024, arXiv 2410.17897, ResFormer): the self-attention of
    # layer n ≥ 2 of a stack attends over V_n ← λ₁·V₁ + λ₂·V_n, V₁ the values of the stack's first
    # layer (before its attention; per position, so cached mixed values are what a full forward
    # computes). λ₁, λ₂ learned scalars per layer, init 0.5 each: the paper's ResFormer fixes both at
    # 1/2 (U_n = A_n·(V_n + V₁)/2), its learnable variant starts there; x-transformers mixes with a
    # fixed 0.5 or a learned per-token sigmoid gate (add_value_residual), which we do not follow.
    # "First" is the first self-attention that RUNS: with layer 1 skipped (LayerDrop) or pruned, the
    # first layer that runs takes its role, as in a model built without it, so pruning == skipping.
    # Every layer has λ (layer 1's act only if it is not the first to run; a pruned stack whose
    # layer 1 is gone rebuilds from its config); the first-running layer adds 0·(λ₁ + λ₂), an exact
    # zero, so its λ still get a (zero) gradient and DDP needs no find_unused_parameters.
    def __init__(self, init: float = 0.5):
        super().__init__()
        self.lambdas = nn.Parameter(torch.full((2,), float(init)))  # (λ₁, λ₂)

    def forward(self, v: torch.Tensor, first: FirstValues | None) -> torch.Tensor:
        if first is None:
            raise ValueError("value residual: a self-attention needs its stack's FirstValues (values=)")
        if first.v is None:  # this layer's values are V₁
            first.v = v
            return v + self.lambdas.sum() * 0.0 if torch.is_grad_enabled() else v
        return self.lambdas[0] * first.v + self.lambdas[1] * v

    def extra_repr(self) -> str:
        return "V ← λ₁·V₁ + λ₂·V"


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0,
                 kdim: int | None = None, vdim: int | None = None, kind: str = "encoder_self",
                 drophead: nn.Module | None = None, inner_norm: nn.Module | None = None,
                 qk_norm: nn.Module | None = None, value_residual: ValueResidual | None = None,
                 bias: bool = True, stability: AttentionStability | None = None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}; allowed values: {', '.join(KINDS)}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout = dropout
        self.kind = kind
        self.q_proj = _projection(embed_dim, embed_dim, bias)
        self.k_proj = _projection(kdim or embed_dim, embed_dim, bias)
        self.v_proj = _projection(vdim or embed_dim, embed_dim, bias)
        self.out_proj = _projection(embed_dim, embed_dim, bias)
        self.drophead = drophead if drophead is not None else nn.Identity()
        qkv_norm = inner_norm if isinstance(inner_norm, QKVNorm) else None  # HybridNorm's, on q, k, v
        self.inner_norm = inner_norm if inner_norm is not None and qkv_norm is None else nn.Identity()
        if qkv_norm is not None and qk_norm is not None:
            raise ValueError("QKV-norm (HybridNorm) already normalises q and k: no QK-norm beside it")
        self.qk_norm = qk_norm  # None: q·k/√d_head as always (no module, so no state-dict key)
        self.qkv_norm = None if qkv_norm is None else qkv_norm.for_heads(self.head_dim)  # None: likewise
        if value_residual is not None and kind == "cross":
            raise ValueError(f"value residual is for self-attention, not kind={kind!r}")
        self.value_residual = value_residual  # None: the values as projected
        self.stability = stability  # None: SDPA on q, k, v as above, no gate

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, *,
                key_padding_mask: torch.Tensor | None = None, causal: bool = False,
                cache: IncrementalCache | None = None, head_mask: torch.Tensor | None = None,
                values: FirstValues | None = None) -> torch.Tensor:
        # x: (B, T, D) queries; memory: (B, S, kdim) for cross-attention, None for self-attention.
        # key_padding_mask: (B, S) bool, True = pad (ignored). head_mask: (B, H), multiplies each
        # head's output (e.g. to measure head importance); training-time DropHead is `drophead`.
        # values: the stack's FirstValues, for the value residual.
        B, T, _ = x.shape
        q, k, v = self._qkv(x, memory, cache, values)  # (B, H, T, Dh); (B / G, H, S, Dh) each
        G = _group(B, k.size(0))
        if G > 1:  # G hypotheses per source row (beam search): their queries share the source's keys
            q = q.view(-1, G, self.num_heads, T, self.head_dim).transpose(1, 2).flatten(2, 3)  # (B/G, H, G·T, Dh)
        attn_mask, is_causal = _attention_mask(key_padding_mask, causal, q.size(2), k.size(2), x.device)
        scale = None if self._qk_norm() is None else self._qk_norm().sdpa_scale  # None: SDPA's 1/√d_head
        attend = F.scaled_dot_product_attention if self.stability is None else self.stability.attend
        out = attend(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                     dropout_p=self.dropout if self.training else 0.0, scale=scale)
        if G > 1:
            out = out.unflatten(2, (G, T)).transpose(1, 2).reshape(B, self.num_heads, T, self.head_dim)
        if self.stability is not None:  # gated attention on the SDPA output, from the queries' input x
            out = self.stability.gated(x, out)
        out = self.drophead(out)  # (B, H, T, Dh)
        if head_mask is not None:
            out = out * head_mask.to(out.dtype)[:, :, None, None]  # (B, H, 1, 1) x (B, H, T, Dh)
        out = out.transpose(1, 2).reshape(B, T, self.embed_dim)  # (B, T, D)
        return self.out_proj(self.inner_norm(out))

    @torch.no_grad()
    def attention_map(self, x: torch.Tensor, memory: torch.Tensor | None = None, *,
                      key_padding_mask: torch.Tensor | None = None, causal: bool = False,
                      **_) -> tuple[torch.Tensor, torch.Tensor]:
        # The logits (scaled as SDPA scales, before a soft-cap; -inf where masked) and the attention
        # probabilities, both (B, H, T, S), that forward's SDPA computes without materialising them:
        # for the stability observatory (callbacks/observatory.py), on one batch, never in training.
        # q and k as forward computes them (QK-norm, QKV-norm, key RMSNorm); no cache.
        first = FirstValues() if self.value_residual is not None else None  # only v depends on it
        q, k, _ = self._qkv(x, memory, None, first)  # (B, H, T, Dh), (B, H, S, Dh)
        attn_mask, is_causal = _attention_mask(key_padding_mask, causal, q.size(2), k.size(2), x.device)
        scale = None if self._qk_norm() is None else self._qk_norm().sdpa_scale  # None: SDPA's 1/√d_head
        stability = self.stability
        return attention_weights(q, k, attn_mask, is_causal, scale, None if stability is None else stability.logit_cap,
                                 None if stability is None else stability.sink)

    def _qk_norm(self) -> nn.Module | None:
        # What normalises q and k: QK-norm, or HybridNorm's QKV-norm (never both), or None.
        return self.qk_norm if self.qk_norm is not None else self.qkv_norm

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)

    def _qkv(self, x, memory, cache, values=None):
        # QK-norm acts per position, so keys are normalised once, when computed, and cached normalised:
        # a cached step sees the same keys as the whole sequence at once; QKV-norm's values likewise.
        qk, qkv = self._qk_norm(), self.qkv_norm
        if memory is not None:
            # Cross-attention: the encoder's keys/values depend only on the source, so a cache
            # computes them at the first step, once per source row, and reuses them for every later
            # step and every hypothesis of that source.
            q = self._split(self.q_proj(x))
            q = q if qk is None else qk.query(q)
            state = cache.source_state(self) if cache is not None else None
            if state:
                return q, state["k"], state["v"]
            k, v = _fused(memory, self.k_proj, self.v_proj)
            k, v = self._split(k), self._split(v)
            k = k if qk is None else qk.key(k)
            v = v if qkv is None else qkv.value(v)
            if self.stability is not None:  # key / value RMSNorm, cached normalised as QK-norm's keys
                k, v = self.stability.key(k), self.stability.value(v)
            if state is not None:
                state["k"], state["v"] = k, v
            return q, k, v
        q, k, v = (self._split(t) for t in _fused(x, self.q_proj, self.k_proj, self.v_proj))
        if qk is not None:
            q, k = qk.query(q), qk.key(k)
        if qkv is not None:  # before the value residual: it mixes the normalised values V₁ and V_n
            v = qkv.value(v)
        if self.stability is not None:  # likewise
            k, v = self.stability.key(k), self.stability.value(v)
        if self.value_residual is not None:  # the new positions' values, mixed before they are cached
            v = self.value_residual(v, values)
        if cache is not None:
            # Self-attention: append this step's keys/values to the prefix's.
            state = cache.state(self)
            if state:
                k = torch.cat([state["k"], k], dim=2)  # (B, H, S_prev + T, Dh)
                v = torch.cat([state["v"], v], dim=2)
            state["k"], state["v"] = k, v
        return q, k, v

    def extra_repr(self) -> str:
        return f"kind={self.kind}, heads={self.num_heads}, dropout={self.dropout}" + (
            "" if self.q_proj.bias is not None else ", bias=False")


def _projection(in_dim: int, out_dim: int, bias: bool) -> nn.Linear:
    # Built with a bias, which is then removed for bias=False: nn.Linear draws its bias from the global
    # generator when it is built, so without it every later draw would move. This way a model.bias=false
    # model draws what model.bias=true draws, and the same seed gives it the same weights (Xavier's,
    # drawn after construction, initialization.py), only without the biases, which start at 0:
    # model.bias is a paired comparison, seed for seed (tests/test_bias.py).
    linear = nn.Linear(in_dim, out_dim)
    if not bias:
        linear.register_parameter("bias", None)
    return linear


def _fused(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    # Projections of one input in one matmul (fused QKV; KV of the memory): the weights are
    # concatenated per call (a d x d copy each, negligible next to the activations) so the separate
    # q/k/v Linear modules stay as they are (state dict, copies from nn.MultiheadAttention, Admin).
    weight = torch.cat([lin.weight for lin in linears])  # (n·D, in)
    bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])  # None: model.bias=false
    return F.linear(x, weight, bias).split([lin.out_features for lin in linears], dim=-1)  # views of (B, T, n·D)


def _group(queries: int, keys: int) -> int:
    # Rows of queries per row of keys/values: 1, or the beam size when the decoder's hypotheses
    # attend to memory kept once per source sentence (memory and its pad mask: (B / G) rows).
    if queries % keys:
        raise ValueError(f"{queries} query rows cannot share {keys} rows of keys/values")
    return queries // keys


class _KeyMask:
    """SDPA's (B, 1, 1, S) boolean mask (True = attend, the opposite of key_padding_mask's True =
    pad) of the last key_padding_mask seen. One forward hands the same (B, S) tensor to every
    encoder self-attention and cross-attention, so the mask is built once, not per layer (issue 21).
    Keyed by the tensor object and its version counter (an in-place change makes it stale; writes
    that bypass the counter, through .numpy(), DLPack or .data, are not seen: normlab's masks are
    fresh src.eq(pad) tensors); the memo holds that tensor, so its id cannot be reused while
    memoised. Built afresh under torch.compile (the graph computes it) and in inference mode (no
    version counter; an inference tensor must not be handed to a later grad-mode call). One tuple,
    read and written whole, so a thread cannot pair one call's mask with another's."""

    def __init__(self):
        self.memo: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (source, its version, mask)

    def __call__(self, key_padding_mask: torch.Tensor) -> torch.Tensor:
        if (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
                or key_padding_mask.is_inference()):
            return ~key_padding_mask[:, None, None, :]
        memo = self.memo
        if memo is not None and memo[0] is key_padding_mask and memo[1] == tensor_version(key_padding_mask):
            return memo[2]
        mask = ~key_padding_mask[:, None, None, :]
        self.memo = (key_padding_mask, tensor_version(key_padding_mask), mask)
        return mask


_key_mask = _KeyMask()


def _attention_mask(key_padding_mask, causal: bool, tq: int, tk: int, device):
    mask = None if key_padding_mask is None else _key_mask(key_padding_mask)  # (B, 1, 1, S)
    if not causal or tq == 1:
        return mask, False  # one new query attends to the whole cached prefix
    if mask is None and tq == tk:
        return None, True  # lets SDPA pick its causal kernel
    # Queries are the last tq of tk positions (a cached prefix): query i sees keys <= i + tk - tq.
    future = torch.ones(tq, tk, dtype=torch.bool, device=device).tril(diagonal=tk - tq)  # (T, S)
    return (future if mask is None else mask & future), False
