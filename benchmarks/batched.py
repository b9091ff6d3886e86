"""K members of one architecture trained as one computation, for batched_members.py (a measurement,
not the product): the members' parameters stacked (K, ...), Adam on the stacked tensors with a
learning rate per member, and two batched forwards to the decoder's output states (K, B, T, D):

- `vmap_states`: the model's own code, `torch.func.functional_call` under `torch.vmap` over the
  stacked parameters, the batch shared (in_dims (0, None, None, None)).
- `bmm_states`: the same function written by hand for the plain schemes (pre- or post-LN,
  LayerNorm, tied embeddings, sinusoidal positions, no dropout): every linear layer a `baddbmm` over
  the members, and attention, which has no parameters, one SDPA call with the members folded into
  its batch dimension (under vmap CPU's SDPA has no batching rule and runs once per member).

The loss is taken per member outside both (losses.projected_label_smoothed_nll, the chunked loss a
single run trains with; its autograd.Function has no vmap rule), summed, with one backward: member
k's gradient is its single run's, as the members share no parameter.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.profiler import record_function

from normlab.losses import projected_label_smoothed_nll
from normlab.lr_schedule import inverse_sqrt_factor
from normlab.model.transformer import Seq2SeqTransformer

OUTPUT = "encoder.embed.tokens.embedding.weight"  # the tied embedding: encoder, decoder and output


def member_lr(peak: float, warmup: int, step: int) -> float:
    """A member's learning rate at optimizer step `step` (1-based), as lit_module's LambdaLR sets it."""
    return peak * inverse_sqrt_factor(step, warmup)


class Stacked:
    """K models' parameters as (K, ...) leaves that are views of one (K, P) buffer, member k's P
    values contiguous in row k (its whole state one vector, in named_parameters' order), and their
    gradients views of another (autograd adds into an existing .grad in place), so Adam is a few
    whole-buffer ops however many tensors the model has. `params` keeps named_parameters' names (a
    tied tensor once, under its first name); functional_call ties the aliases back."""

    def __init__(self, models: list[Seq2SeqTransformer], betas=(0.9, 0.98), eps: float = 1e-9):
        self.K = len(models)
        named = [dict(m.named_parameters()) for m in models]
        ref = next(iter(named[0].values()))
        total = sum(p.numel() for p in named[0].values())
        self.flat = torch.empty(self.K, total, dtype=ref.dtype, device=ref.device)
        self.grad = torch.zeros_like(self.flat)
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
        self.params, off = {}, 0
        for name, p0 in named[0].items():
            n = p0.numel()
            view = self.flat[:, off:off + n].view(self.K, *p0.shape)
            with torch.no_grad():
                view.copy_(torch.stack([nm[name] for nm in named]))
            view.requires_grad_(True)
            view.grad = self.grad[:, off:off + n].view(self.K, *p0.shape)
            self.params[name] = view
            off += n
        self.buffers = dict(models[0].named_buffers())  # the sinusoid tables: the same for every member
        self.template = copy.deepcopy(models[0]).to("meta")  # the modules only; functional_call fills them
        self.cfg = models[0].cfg
        self.betas, self.eps, self.steps = betas, eps, 0

    def zero_grad(self) -> None:
        self.grad.zero_()

    def member(self, k: int) -> dict[str, torch.Tensor]:
        return {name: p[k] for name, p in self.params.items()}

    @torch.no_grad()
    def adam_step(self, lrs: list[float]) -> None:
        """torch.optim.Adam's update (amsgrad off, no weight decay; its foreach path's order of
        operations) with member k at lrs[k]. Elementwise, so member k's update is the one
        torch.optim.Adam makes from the same gradient: the per-member step size enters as a column,
        p + (m·s)/d with s = -lr/(1 - β₁ᵗ) rounded to the parameters' dtype, which is addcdiv's
        p + s·m/d operation for operation (tests/test_batched_members.py)."""
        b1, b2 = self.betas
        self.steps += 1
        bc1, bc2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
        self.exp_avg.lerp_(self.grad, 1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(self.grad, self.grad, value=1 - b2)
        denom = self.exp_avg_sq.sqrt().div_(bc2 ** 0.5).add_(self.eps)
        step_size = torch.tensor([(lr / bc1) * -1 for lr in lrs], dtype=self.flat.dtype, device=self.flat.device)
        self.flat.addcdiv_(self.exp_avg * step_size[:, None], denom)


def members_loss(states: torch.Tensor, output_weight: torch.Tensor, tgt_out: torch.Tensor, ntokens: int,
                 eps: float = 0.1, pad_id: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(Σ_k loss_k / ntokens, [loss_k / ntokens]): member k's loss is its single run's training loss."""
    losses = [projected_label_smoothed_nll(states[k], output_weight[k], tgt_out, eps, pad_id)[0] / ntokens
              for k in range(states.size(0))]
    return torch.stack(losses).sum(), [x.detach() for x in losses]


def vmap_states(st: Stacked, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
    def one(params, buffers, s, t):
        return functional_call(st.template, (params, buffers), (s, t), {"project": False})
    return torch.vmap(one, in_dims=(0, None, None, None))(st.params, st.buffers, src, tgt_in)


# ---- the hand-batched forward ----------------------------------------------------------------

def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # x (K, N, in), w (K, out, in), b (K, out): each member's x wᵀ + b in one batched matmul
    wt = w.transpose(1, 2)
    return torch.bmm(x, wt) if b is None else torch.baddbmm(b.unsqueeze(1), x, wt)


def _norm(p: dict, name: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    # LayerNorm with a gain and bias per member: the statistics need none, the affine broadcasts
    y = F.layer_norm(x, x.shape[-1:], None, None, eps)
    w, b = p[f"{name}.weight"][:, None, None], p.get(f"{name}.bias")
    return y * w if b is None else torch.addcmul(b[:, None, None], y, w)


def _attention(p: dict, name: str, x: torch.Tensor, memory: torch.Tensor | None, heads: int,
               mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    K, B, T, D = x.shape
    def g(proj: str, kind: str) -> torch.Tensor | None:
        return p.get(f"{name}.{proj}_proj.{kind}")

    def cat(projs: str, kind: str) -> torch.Tensor | None:  # fused projections: (K, n·D, in)
        return None if g(projs[0], kind) is None else torch.cat([g(q, kind) for q in projs], 1)

    if memory is None:  # fused QKV, as attention.py
        q, k, v = _linear(x.flatten(1, 2), cat("qkv", "weight"), cat("qkv", "bias")).split(D, -1)
        S = T
    else:  # queries from x, fused KV from the encoder's output
        S = memory.size(2)
        q = _linear(x.flatten(1, 2), g("q", "weight"), g("q", "bias"))
        k, v = _linear(memory.flatten(1, 2), cat("kv", "weight"), cat("kv", "bias")).split(D, -1)
    # no parameters in attention itself: the members are K·B rows of one SDPA call
    split = lambda t, L: t.reshape(K * B, L, heads, D // heads).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(split(q, T), split(k, S), split(v, S), attn_mask=mask, is_causal=causal)
    return _linear(out.transpose(1, 2).reshape(K, B * T, D), g("out", "weight"), g("out", "bias")).view(K, B, T, D)


def _ffn(p: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    K, B, T, D = x.shape
    h = F.relu(_linear(x.flatten(1, 2), p[f"{name}.fc1.weight"], p.get(f"{name}.fc1.bias")))
    return _linear(h, p[f"{name}.fc2.weight"], p.get(f"{name}.fc2.bias")).view(K, B, T, D)


def _block(p: dict, name: str, x: torch.Tensor, pre: bool, eps: float, fn) -> torch.Tensor:
    # pre: x + F(N(x)); post: N(x + F(x)) (schemes/classic.py)
    if pre:
        return x + fn(_norm(p, f"{name}.norm", x, eps))
    return _norm(p, f"{name}.norm", x + fn(x), eps)


def _embed(p: dict, tokens: torch.Tensor, table: torch.Tensor, K: int) -> torch.Tensor:
    # nn.Embedding's padding row gets no gradient from the lookup: one F.embedding per member keeps that
    w = p[OUTPUT]
    e = torch.stack([F.embedding(tokens, w[k], padding_idx=0) for k in range(K)])  # (K, B, T, D)
    return e * math.sqrt(w.size(-1)) + table[: tokens.size(1)]


def supported(cfg) -> str | None:
    """Why bmm_states cannot run this model config, or None."""
    checks = {"norm.placement": (cfg.norm.placement, ("pre", "post")), "norm.type": (cfg.norm.type, ("layernorm",)),
              "dropout": (max(cfg.dropout, cfg.attention_dropout, cfg.activation_dropout), (0.0,)),
              "share/tie embeddings": (cfg.share_embeddings and cfg.tie_output_embeddings, (True,)),
              "learned_positions": (cfg.learned_positions, (False,)), "init": (cfg.init, ("xavier",)),
              "residual": (cfg.residual, ("add",)), "layer_aggregation": (cfg.layer_aggregation, ("none",)),
              "qk_norm": (cfg.qk_norm, ("none",)), "value_residual": (cfg.value_residual, (False,)),
              "fixnorm": (cfg.norm.fixnorm, (False,)), "attn_gate": (cfg.attn_gate, ("none",)),
              "attn_sink": (cfg.attn_sink, (False,)), "attn_softcap": (cfg.attn_softcap, (None,)),
              "logit_softcap": (cfg.logit_softcap, (None,)), "k_norm": (cfg.k_norm, (False,)),
              "v_norm": (cfg.v_norm, (False,))}
    bad = [f"{k}={v}" for k, (v, ok) in checks.items() if v not in ok]
    return ", ".join(bad) or None


def bmm_states(st: Stacked, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
    cfg, p, K = st.cfg, st.params, st.K
    why = supported(cfg)
    if why:
        raise ValueError(f"bmm_states: not written for {why}")
    pre, eps = cfg.norm.placement == "pre", cfg.norm.eps
    B, S = src.shape
    keep = ~src.eq(cfg.pad_id)[:, None, None, :]  # SDPA's True = attend, (B, 1, 1, S)
    mask = keep.expand(K, B, 1, 1, S).reshape(K * B, 1, 1, S)
    x = _embed(p, src, st.buffers["encoder.embed.positions.table"], K)
    for i in range(cfg.encoder_layers):
        n = f"encoder.layers.{i}"
        x = _block(p, f"{n}.self_attn", x, pre, eps,
                   lambda h: _attention(p, f"{n}.self_attn.sublayer", h, None, cfg.encoder_heads, mask, False))
        x = _block(p, f"{n}.ffn", x, pre, eps, lambda h: _ffn(p, f"{n}.ffn.sublayer", h))
    memory = _norm(p, "encoder.final_norm", x, eps) if pre else x
    y = _embed(p, tgt_in, st.buffers["decoder.embed.positions.table"], K)
    for i in range(cfg.decoder_layers):
        n = f"decoder.layers.{i}"
        y = _block(p, f"{n}.self_attn", y, pre, eps,
                   lambda h: _attention(p, f"{n}.self_attn.sublayer", h, None, cfg.decoder_heads, None, True))
        y = _block(p, f"{n}.cross_attn", y, pre, eps,
                   lambda h: _attention(p, f"{n}.cross_attn.sublayer", h, memory, cfg.decoder_heads, mask, False))
        y = _block(p, f"{n}.ffn", y, pre, eps, lambda h: _ffn(p, f"{n}.ffn.sublayer", h))
    return _norm(p, "decoder.final_norm", y, eps) if pre else y


FORWARDS = {"vmap": vmap_states, "bmm": bmm_states}


def batched_step(st: Stacked, forward, batch: dict, lrs: list[float]) -> list[torch.Tensor]:
    """One training step of every member: forward, loss, one backward, Adam. Member k's loss / ntokens."""
    # the phases are named for torch.profiler (batched_members.py --profile)
    st.zero_grad()
    with record_function("forward"):
        states = forward(st, batch["src"], batch["tgt_in"])
    with record_function("loss"):  # the chunked loss makes its gradient here too
        total, losses = members_loss(states, st.params[OUTPUT], batch["tgt_out"], batch["ntokens"])
    with record_function("backward"):
        total.backward()
    with record_function("adam"):
        st.adam_step(lrs)
    return losses
