"""Label-smoothed cross-entropy (Vaswani et al. 2017, 5.4; Szegedy et al. 2016).

Two conventions exist and papers rarely say which they used:
- ``uniform`` (default; Szegedy et al. 2016 and ``F.cross_entropy(label_smoothing=eps)``):
  q = (1 - eps) * onehot + eps / V over all V classes.
- ``fairseq`` (``label_smoothed_cross_entropy``): the gold class gets 1 - eps and the other
  V - 1 classes share eps, i.e. eps / (V - 1) each.
PAD targets never count: they are masked out of both terms.

Both are loss = a·nll + b·smooth per token, with nll = -log p_y and smooth = -Σ_v log p_v, so the
gradient wrt the logits has a closed form: keep · ((a + b·V)·softmax - a·onehot - b). From
logits, the autograd Function saves only the log-probabilities and computes that gradient in place
in one new (N, V) tensor (autograd through log_softmax, gather and sum would allocate four: the
gather's scattered zeros, the sum's expanded gradient, their sum and log_softmax's gradient).
Training goes further (`model_loss`): the output projection and the loss are taken together in
row chunks, so the (N, V) logits never exist at all. Pads are masked by multiplication, not boolean indexing, which would
read the mask back to the host (a device sync per step on GPU).
"""
from __future__ import annotations

import torch

CONVENTIONS = ("uniform", "fairseq")


def _sums(lprobs: torch.Tensor, target: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (Σ nll, Σ smooth) over kept rows; lprobs (N, V), target (N, 1) (a column: _logit_grad_ takes
    # the same one), keep (N,) 0/1 floats.
    nll = -(lprobs.gather(1, target).squeeze(1) * keep).sum()
    return nll, -(lprobs.sum(dim=-1) * keep).sum()


def _grad_coefficients(coef_onehot: torch.Tensor, coef_uniform: torch.Tensor, V: int) -> tuple[torch.Tensor, ...]:
    # The 0-dim factors of keep in _logit_grad_ for c_1·nll + c_u·smooth: (c_1 + c_u·V, -c_u, -c_1),
    # once per loss rather than once per row chunk. Nothing is read back to the host.
    return coef_onehot + coef_uniform * V, -coef_uniform, -coef_onehot


def _logit_grad_(lprobs: torch.Tensor, target: torch.Tensor, keep: torch.Tensor,
                 coefs: tuple[torch.Tensor, ...], z_rows: torch.Tensor | None = None) -> torch.Tensor:
    # In place: log-probs -> keep · ((c_1 + c_u·V)·p - c_1·onehot - c_u), the gradient wrt the logits
    # of c_1·nll + c_u·smooth; coefs from _grad_coefficients, target (N, 1). (-c)·keep is -(c·keep)
    # bit for bit: rounding to nearest is symmetric in the sign. z_rows (N,): the z-loss's
    # d(z·log²Z)/d logits = 2z·log Z · p per kept row, added to p's factor (None: no z-loss).
    scale, neg_uniform, neg_onehot = coefs
    p_factor = scale * keep if z_rows is None else scale * keep + z_rows
    grad = torch.addcmul((neg_uniform * keep)[:, None], lprobs.exp_(), p_factor[:, None], out=lprobs)
    return grad.scatter_add_(1, target, (neg_onehot * keep)[:, None])  # addcmul: one pass


def _coefficients(eps: float, V: int, convention: str) -> tuple[float, float]:
    # loss = a·nll + b·smooth for each convention (module docstring).
    if convention not in CONVENTIONS:
        raise ValueError(f"label smoothing convention {convention!r}; allowed: {', '.join(CONVENTIONS)}")
    if convention == "uniform":
        return 1.0 - eps, eps / V
    b = eps / (V - 1)
    return 1.0 - eps - b, b


class _SmoothedNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, a: float, b: float, pad_id: int):
        # logits (N, V), any float dtype; log-probabilities in at least fp32 (bf16/fp16 logits too).
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lprobs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (N, V)
        keep = target.ne(pad_id).to(dtype)  # (N,)
        nll, smooth = _sums(lprobs, target[:, None], keep)
        ctx.save_for_backward(lprobs, target, keep)
        ctx.a, ctx.b, ctx.logits_dtype = a, b, logits.dtype
        return a * nll + b * smooth, nll

    @staticmethod
    def backward(ctx, g_loss, g_nll):
        # d(a·nll + b·smooth) = (a + b·V)·p - a·onehot - b per kept row; the nll output adds
        # g_nll·(p - onehot). A copy of the saved log-probs (kept for retain_graph) becomes it.
        lprobs, target, keep = ctx.saved_tensors
        zero = lprobs.new_zeros(())
        g_loss = zero if g_loss is None else g_loss
        g_nll = zero if g_nll is None else g_nll
        coefs = _grad_coefficients(g_loss * ctx.a + g_nll, g_loss * ctx.b, lprobs.size(1))
        grad = _logit_grad_(lprobs.clone(), target[:, None], keep, coefs)
        return grad.to(ctx.logits_dtype), None, None, None, None


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_id: int,
                       convention: str = "uniform") -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (smoothed loss, nll), both summed over the non-pad tokens."""
    V = logits.size(-1)
    a, b = _coefficients(eps, V, convention)
    return _SmoothedNLL.apply(logits.reshape(-1, V), target.reshape(-1), a, b, pad_id)


# Rows of logits per chunk: 4M elements (16 MB in fp32) stays in the CPU allocator's reusable heap
# (glibc maps larger blocks afresh each time); on GPU larger chunks mean fewer kernel launches.
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}


class _ProjectedSmoothedNLL(torch.autograd.Function):
    # The loss of logits = x Wᵀ, taken in row chunks: each chunk's logits become its gradient in
    # place and are multiplied out into dL/dx and dL/dW at once (as in Liger's fused linear
    # cross-entropy), so no (N, V) tensor exists; backward only scales the two by dL/dloss.
    # Every chunk writes into the same buffers, (C, V) logits, (C, V) log-probs that become the
    # gradient, (V, D) for its share of dL/dW, and its dL/dx rows straight into dL/dx: on CPU fresh
    # tensors of that size in every chunk cost 10-15% of the loss. Bit for bit the same sums.
    # cap (model.logit_softcap): the logits are c·tanh(xWᵀ/c) (Gemma 2), capped in place in their buffer;
    # the gradient wrt xWᵀ is the one wrt the capped logits times 1 − (capped/c)².
    @staticmethod
    def forward(ctx, x, weight, target, a: float, b: float, pad_id: int, grads: bool, z: float = 0.0,
                cap: float | None = None):
        N, V = x.size(0), weight.size(0)
        rows = max(1, CHUNK_ELEMENTS.get(x.device.type, 1 << 22) // V)
        acc = torch.promote_types(x.dtype, torch.float32)
        # The matmuls' dtype here (bf16 under autocast, which does not cast for out= calls): cast once.
        mm = (x[:1] @ weight[:1].t()).dtype
        xm, wm = x.to(mm), weight.to(mm)
        wt = wm.t()  # once, not per chunk (issue 21: ops per step at small shapes)
        one = torch.ones((), dtype=acc, device=x.device)
        coefs = _grad_coefficients(one * a, one * b, V) if grads else None
        loss, nll, zsum = x.new_zeros((), dtype=acc), x.new_zeros((), dtype=acc), x.new_zeros((), dtype=acc)
        gx = torch.empty_like(x) if grads else None
        gw = torch.zeros(weight.shape, dtype=acc, device=x.device) if grads else None
        logits_buf = torch.empty(min(rows, N), V, dtype=mm, device=x.device)
        lprobs_buf = torch.empty(min(rows, N), V, dtype=acc, device=x.device)
        gw_buf = torch.empty(weight.shape, dtype=mm, device=x.device) if grads else None
        for i in range(0, N, rows):
            xc, tc = xm[i:i + rows], target[i:i + rows]
            logits = torch.mm(xc, wt, out=logits_buf[:xc.size(0)])  # (C, V)
            if cap is not None:
                logits = logits.div_(cap).tanh_().mul_(cap)
            lprobs = torch.log_softmax(logits, dim=-1, dtype=acc, out=lprobs_buf[:xc.size(0)])
            keep = tc.ne(pad_id).to(acc)
            tc = tc[:, None]  # (C, 1), as _sums and _logit_grad_ take it
            n, s = _sums(lprobs, tc, keep)
            loss, nll = loss + a * n + b * s, nll + n
            z_rows = None
            if z:  # z-loss (PaLM, Chowdhery et al. 2022, 5): z·log²Z per kept target, log Z = logit - log-prob
                log_z = logits[:, 0].to(acc) - lprobs[:, 0]  # (C,): log_softmax's own normaliser
                zsum = zsum + (log_z.square() * keep).sum()
                z_rows = (2.0 * z) * log_z * keep
            if grads:
                g = _logit_grad_(lprobs, tc, keep, coefs, z_rows)  # (C, V)
                if cap is not None:  # d(c·tanh(u/c))/du = 1 − tanh²(u/c)
                    g.mul_(logits.to(acc).div(cap).square_().neg_().add_(1.0))
                g = g if g.dtype == mm else g.to(mm)  # no aten::to call when already there (fp32)
                if gx.dtype == mm:
                    torch.mm(g, wm, out=gx[i:i + rows])
                else:
                    gx[i:i + rows] = g @ wm
                gw += torch.mm(g.t(), xc, out=gw_buf)
        ctx.save_for_backward(gx, gw)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(nll, zsum)
        return (loss + z * zsum if z else loss), nll, zsum

    @staticmethod
    def backward(ctx, g_loss, g_nll, g_zsum):
        gx, gw = ctx.saved_tensors
        return gx * g_loss, (gw * g_loss).to(ctx.weight_dtype), None, None, None, None, None, None, None


def projected_label_smoothed_nll(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, eps: float,
                                 pad_id: int, convention: str = "uniform", z_loss: float = 0.0,
                                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """label_smoothed_nll(x @ weight.T, ...) for x (..., D), weight (V, D), without the logits tensor
    (of softcap·tanh(x @ weight.T / softcap) with a softcap, model.logit_softcap):
    (objective, nll, Σ log²Z), each summed over non-pad targets. The objective is the smoothed loss,
    plus z_loss · Σ log²Z when z_loss > 0 (at 0, Σ log²Z is not computed: 0). Only the objective is
    differentiable."""
    a, b = _coefficients(eps, weight.size(0), convention)
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _ProjectedSmoothedNLL.apply(x.reshape(-1, x.size(-1)), weight, target.reshape(-1), a, b, pad_id, grads,
                                       float(z_loss), None if softcap is None else float(softcap))


def model_loss(model, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, eps: float, pad_id: int,
               convention: str = "uniform", z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training objective of a Seq2SeqTransformer: (smoothed loss [+ z-loss], nll, Σ log²Z) summed
    over non-pad targets."""
    out = model.output_projection
    x, weight = out.operands(model(src, tgt_in, project=False))
    return projected_label_smoothed_nll(x, weight, tgt_out, eps, pad_id, convention, z_loss, out.softcap)
