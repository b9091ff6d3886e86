"""The stability observatory's statistics (issue 38): pure functions of activations, attention maps
and gradient norms; the callback that measures them is callbacks/observatory.py.

Activations x (..., D) come with a token mask (...,) (True = a real token, pads left out). Attention
comes as the logits s and probabilities p of one attention module, (B, H, T, S), with a query mask
(B, T): a key a mask hides has s = -inf and p = 0, so only the queries need a mask. Each statistic is
averaged over the real tokens (or query rows) of the batch.

- rms, max_abs   √mean(x²) and max|x| over every real token's D features.
- excess kurtosis  Fisher's, m₄/m₂² − 3 with central moments over a token's D features, averaged over
  the real tokens: the outlier-feature measure of Outlier-Safe Pre-Training (Park et al., ACL 2025,
  arXiv 2506.19697: 1818.56 for an Adam-trained 1.4B model, 0.04 with OSP), which follows Bondarenko
  et al. 2023 (Quantizable Transformers) in taking it over the hidden dimension of a layer's
  activations. A token whose features are Gaussian scores ≈ 0; one feature k standard deviations out
  among D lifts it towards D: the number grows with the outlier features themselves. A token with
  all-equal features (m₂ = 0) has no kurtosis and is left out.
- entropy        −Σ_j p_j log p_j per head over the keys (nats); log n for uniform attention over n keys.
- sink rate      the share of attention on key position 0 (the first token), per head: Xiao et al. 2024
  (StreamingLLM) name the heads that park their attention there attention sinks. With a learned sink
  (model.attn_sink) the rows sum to less than 1 and the entropy is over the keys' share.
- max logit      the largest pre-softmax logit q·k/√d_head (or g·q̂·k̂ under QK-norm: as SDPA scales it),
  before a soft-cap: its growth is the attention-logit instability of Dehghani et al. 2023 (ViT-22B)
  and Wortsman et al. 2023.
- gradient spike score  a layer's gradient norm over the median of its last `window` norms (the rule of
  optim.skip_spikes, spikes.py, per layer); GradWindow reports the largest since the last report.
"""
from __future__ import annotations

import torch


def _real(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # (N, D): the real tokens' feature vectors, in at least fp32
    x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return x.reshape(-1, x.size(-1)) if mask is None else x[mask]


def rms(x: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    return _real(x, mask).pow(2).mean().sqrt().item()


def max_abs(x: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    return _real(x, mask).abs().max().item()


def token_kurtosis(x: torch.Tensor) -> torch.Tensor:
    """Fisher's excess kurtosis of each row of x (N, D) over its D values (population moments), (N,)."""
    c = x - x.mean(-1, keepdim=True)
    c2 = c * c
    m2 = c2.mean(-1)
    return (c2 * c2).mean(-1) / (m2 * m2) - 3.0


def _kurtosis(rows: torch.Tensor) -> float:
    # rows (N, D): the mean over the rows with spread (m₂ > 0), nan when none has any
    k = token_kurtosis(rows)
    k = k[k.isfinite()]
    return k.mean().item() if k.numel() else float("nan")


def excess_kurtosis(x: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """The real tokens' mean excess kurtosis over the feature dimension; nan when none has spread."""
    return _kurtosis(_real(x, mask))


def stream_stats(x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """rms, max_abs and kurtosis of the real tokens, which are selected once."""
    rows = _real(x, mask)
    return {"rms": rows.pow(2).mean().sqrt().item(), "max_abs": rows.abs().max().item(), "kurtosis": _kurtosis(rows)}


def _rows(stat: torch.Tensor, query_mask: torch.Tensor | None) -> list[float]:
    # stat (B, H, T) -> per head, mean over the real query rows
    if query_mask is None:
        return stat.mean((0, 2)).tolist()
    w = query_mask[:, None, :].to(stat.dtype)  # (B, 1, T)
    return ((stat * w).sum((0, 2)) / w.sum((0, 2))).tolist()


def attention_entropy(p: torch.Tensor, query_mask: torch.Tensor | None = None) -> list[float]:
    """Per head: the mean over real queries of −Σ_j p_j log p_j (0·log 0 = 0: masked keys add nothing)."""
    return _rows(-torch.xlogy(p, p).sum(-1), query_mask)


def sink_rate(p: torch.Tensor, query_mask: torch.Tensor | None = None) -> list[float]:
    """Per head: the mean over real queries of the attention on key position 0."""
    return _rows(p[..., 0], query_mask)


def max_logit(s: torch.Tensor, query_mask: torch.Tensor | None = None) -> float:
    """The largest logit of a real query over the keys it sees (masked keys are -inf)."""
    if query_mask is not None:
        s = s.masked_fill(~query_mask[:, None, :, None], float("-inf"))
    return s.max().item()


def attention_stats(s: torch.Tensor, p: torch.Tensor, query_mask: torch.Tensor | None = None) -> dict[str, float]:
    """One attention module's scores: entropy_h<i> and sink_h<i> per head, max_logit."""
    out = {f"entropy_h{h}": v for h, v in enumerate(attention_entropy(p, query_mask))}
    out.update({f"sink_h{h}": v for h, v in enumerate(sink_rate(p, query_mask))})
    out["max_logit"] = max_logit(s, query_mask)
    return out


class GradWindow:
    """The last `window` per-layer gradient norms, on the device (no host sync per step): add() once per
    update, report() at a validation. A non-finite norm is kept as nan and enters no median."""

    def __init__(self, window: int):
        self.window = int(window)
        self.norms: torch.Tensor | None = None  # (window, L), a ring
        self.count = 0  # updates added in all
        self.since = 0  # updates added since the last report

    def add(self, norms: torch.Tensor) -> None:
        norms = norms.detach().float()
        if self.norms is not None and self.norms.device != norms.device:  # loaded (CPU), then trained on a GPU
            self.norms = self.norms.to(norms.device)
        if self.norms is None or self.norms.size(1) != norms.numel():  # the first, or a pruned model's
            self.norms, self.count, self.since = norms.new_full((self.window, norms.numel()), float("nan")), 0, 0
        self.norms[self.count % self.window] = torch.where(norms.isfinite(), norms, float("nan"))
        self.count += 1
        self.since += 1

    def ordered(self) -> torch.Tensor:
        """(n, L), oldest first (n = min(count, window))."""
        n = min(self.count, self.window)
        if n < self.window:
            return self.norms[:n]
        return torch.roll(self.norms, -(self.count % self.window), 0)

    def report(self) -> tuple[list[float], list[float]] | None:
        """(the last update's norms, the spike score: the largest norm / median ratio of each layer over
        the updates since the last report, at most `window` of them), None before the first update."""
        if self.norms is None or self.count == 0:
            return None
        rows = self.ordered()
        median = rows.nanmedian(0).values  # (L,); torch's lower middle value for an even count
        recent = rows[-max(1, min(self.since, rows.size(0))):] / median  # (k, L)
        spike = torch.where(recent.isnan(), float("-inf"), recent).max(0).values
        self.since = 0
        spike = torch.where(spike.isinf() & (spike < 0), float("nan"), spike)
        return rows[-1].tolist(), spike.tolist()

    def state_dict(self) -> dict:
        return {"norms": [] if self.norms is None else self.ordered().tolist(), "since": self.since}

    def load_state_dict(self, state: dict) -> None:
        self.norms, self.count, self.since = None, 0, 0
        for row in state.get("norms", []):
            self.add(torch.tensor(row))
        self.since = min(int(state.get("since", 0)), self.count)
