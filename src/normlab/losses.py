"""Label-smoothed cross-entropy (Vaswani et al. 2017, 5.4; Szegedy et al. 2016).

Two conventions exist and papers rarely say which they used:
- ``uniform`` (default; Szegedy et al. 2016 and ``F.cross_entropy(label_smoothing=eps)``):
  q = (1 - eps) * onehot + eps / V over all V classes.
- ``fairseq`` (``label_smoothed_cross_entropy``): the gold class gets 1 - eps and the other
  V - 1 classes share eps, i.e. eps / (V - 1) each.
PAD targets never count: they are masked out of both terms.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CONVENTIONS = ("uniform", "fairseq")


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_id: int,
                       convention: str = "uniform") -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (smoothed loss, nll), both summed over the non-pad tokens."""
    if convention not in CONVENTIONS:
        raise ValueError(f"label smoothing convention {convention!r}; allowed: {', '.join(CONVENTIONS)}")
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.size(-1))  # (N, V)
    target = target.reshape(-1)
    keep = target.ne(pad_id)
    nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1)
    smooth = -lprobs.sum(dim=-1)
    nll, smooth = nll[keep].sum(), smooth[keep].sum()
    V = lprobs.size(-1)
    if convention == "uniform":
        loss = (1.0 - eps) * nll + (eps / V) * smooth
    else:
        eps_i = eps / (V - 1)
        loss = (1.0 - eps - eps_i) * nll + eps_i * smooth
    return loss, nll
