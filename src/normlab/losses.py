"""Label-smoothed cross-entropy (Vaswani et al. 2017, 5.4; Szegedy et al. 2016).

Two conventions exist and papers rarely say which they used:
- ``uniform`` (default; Szegedy et al. 2016 and ``F.cross_entropy(label_smoothing=eps)``):
  q = (1 - eps) * onehot + eps / V over all V classes.
- ``fairseq`` (``label_smoothed_cross_entropy``): the gold class gets 1 - eps and the other
  V - 1 classes share eps, i.e. eps / (V - 1) each.
PAD targets never count: they are masked out of both terms.

Both are loss = a·nll + b·smooth per token, with nll = -log p_y and smooth = -Σ_v log p_v, so the
gradient wrt the logits has a closed form: keep · ((a + b·V)·softmax - a·onehot - b). The
autograd Function below saves only the log-probabilities and computes that gradient in place in
one new (N, V) tensor (autograd through log_softmax, gather and sum would allocate four: the
gather's scattered zeros, the sum's expanded gradient, their sum and log_softmax's gradient). Pads are masked by multiplication, not boolean indexing, which would
read the mask back to the host (a device sync per step on GPU).
"""
from __future__ import annotations

import torch

CONVENTIONS = ("uniform", "fairseq")


class _SmoothedNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, a: float, b: float, pad_id: int):
        # logits (N, V), any float dtype; log-probabilities in at least fp32 (bf16/fp16 logits too).
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lprobs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (N, V)
        keep = target.ne(pad_id).to(dtype)  # (N,)
        nll = -(lprobs.gather(1, target[:, None]).squeeze(1) * keep).sum()
        smooth = -(lprobs.sum(dim=-1) * keep).sum()
        ctx.save_for_backward(lprobs, target, keep)
        ctx.a, ctx.b, ctx.logits_dtype = a, b, logits.dtype
        return a * nll + b * smooth, nll

    @staticmethod
    def backward(ctx, g_loss, g_nll):
        # d(a·nll + b·smooth)/dlogits = (a + b·V)·p - a·onehot - b per kept row; the nll output adds
        # g_nll·(p - onehot). The saved log-probs stay intact (retain_graph, gradcheck).
        lprobs, target, keep = ctx.saved_tensors
        V = lprobs.size(1)
        zero = lprobs.new_zeros(())
        g_loss = zero if g_loss is None else g_loss
        g_nll = zero if g_nll is None else g_nll
        coef_onehot = g_loss * ctx.a + g_nll  # 0-dim, stays on the device: no host sync
        coef_uniform = g_loss * ctx.b
        grad = lprobs.exp()  # (N, V) softmax, then in place
        grad.mul_(((coef_onehot + coef_uniform * V) * keep)[:, None])
        grad.scatter_add_(1, target[:, None], (-coef_onehot * keep)[:, None])
        grad.sub_((coef_uniform * keep)[:, None])
        return grad.to(ctx.logits_dtype), None, None, None, None


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_id: int,
                       convention: str = "uniform") -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (smoothed loss, nll), both summed over the non-pad tokens."""
    if convention not in CONVENTIONS:
        raise ValueError(f"label smoothing convention {convention!r}; allowed: {', '.join(CONVENTIONS)}")
    V = logits.size(-1)
    if convention == "uniform":
        a, b = 1.0 - eps, eps / V
    else:
        b = eps / (V - 1)
        a = 1.0 - eps - b
    return _SmoothedNLL.apply(logits.reshape(-1, V), target.reshape(-1), a, b, pad_id)
