"""Batched beam search over the model's incremental (KV-cached) decoder.

Scoring (Wu et al. 2016, GNMT; Vaswani et al. 2017 use beam 4, α = 0.6):
    score(Y) = log P(Y | X) / lp(|Y|),   lp(n) = ((5 + n) / 6)^α
where log P(Y | X) sums the log-probabilities of every output token *including the final EOS*,
and |Y| counts those same tokens, EOS included (fairseq counts EOS in the length it normalises
by too). log-probabilities come from a softmax over the whole vocabulary; PAD and BOS are then
forbidden (-inf) without renormalising, as fairseq does.

Length limit per sentence: at most `max_len = min(max_len_a · |src| + max_len_b, max_positions - 1)`
tokens before EOS (|src| counts non-pad source ids, EOS included; Vaswani et al. 2017 decode up
to |src| + 50). A hypothesis still open after max_len tokens is closed with a forced EOS whose
log-probability is counted, so it is scored like any other (the - 1 leaves a position for it).
`min_len` forbids EOS before that many tokens.

Search (fairseq's SequenceGenerator, vectorised over sentences and beams): every step scores
all beam x vocab extensions in one topk of 2·beam candidates; EOS candidates ranked within the
first `beam` are finished (moved to a per-sentence pool of the `beam` best finished hypotheses),
the best `beam` non-EOS candidates continue. A sentence stops when `beam` hypotheses have
finished (counted over all steps) or it reaches max_len; finished sentences leave the batch.
The encoder output, its pad mask and the cross-attention keys/values stay at one row per source
sentence: the K hypotheses of a sentence attend to them together (attention.py), so they are
computed once and copied only when sentences leave the batch; the self-attention cache follows
the beams by `reorder`. `incremental=False` re-decodes the whole prefix every step instead (the reference
for tests and the uncached baseline of benchmarks/decoding.py); everything else is shared.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def length_penalty(length: torch.Tensor | int, alpha: float) -> torch.Tensor:
    # GNMT: lp(n) = ((5 + n) / 6)^α; n counts output tokens including EOS.
    return ((5.0 + torch.as_tensor(length, dtype=torch.float32)) / 6.0) ** alpha


def max_lengths(src_pad_mask: torch.Tensor, max_len_a: float, max_len_b: int, max_positions: int) -> torch.Tensor:
    # (B,) tokens allowed before EOS; one position is kept for the EOS (see the module docstring).
    src_len = (~src_pad_mask).sum(dim=1)
    return (src_len * max_len_a + max_len_b).long().clamp(min=1, max=max_positions - 1)


@torch.no_grad()
def beam_search(model, src: torch.Tensor, beam: int = 4, lenpen: float = 0.6, max_len_a: float = 1.0,
                max_len_b: int = 50, min_len: int = 0, nbest: int | None = None,
                incremental: bool = True) -> list[list[dict]]:
    """Per source row, up to `nbest` (default `beam`) hypotheses, best first, each
    {"tokens": ids without BOS/EOS/PAD, "score": log P / lp(|Y|), "logprob": log P}."""
    if beam < 1:
        raise ValueError(f"beam={beam} must be >= 1")
    nbest = beam if nbest is None else nbest
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest={nbest} must be between 1 and beam={beam}")
    was_training = model.training
    model.eval()
    try:
        return _search(model, src, beam, lenpen, max_len_a, max_len_b, min_len, nbest, incremental)
    finally:
        model.train(was_training)


def _search(model, src, K, alpha, max_len_a, max_len_b, min_len, nbest, incremental):
    cfg = model.cfg
    dev = src.device
    memory, src_pad_mask = model.encode(src)  # (B, S, D), (B, S)
    B = src.size(0)
    max_len = max_lengths(src_pad_mask, max_len_a, max_len_b, cfg.max_positions)  # (B,)
    T = int(max_len.max())  # longest hypothesis, tokens before EOS
    V = cfg.vocab_size
    # Finished pool per original sentence: the K best finished hypotheses by normalised score.
    pool_score = torch.full((B, K), NEG_INF, device=dev)
    pool_logp = torch.full((B, K), NEG_INF, device=dev)
    pool_len = torch.zeros((B, K), dtype=torch.long, device=dev)
    pool_tok = torch.full((B, K, T), cfg.pad_id, dtype=torch.long, device=dev)
    n_finished = torch.zeros(B, dtype=torch.long, device=dev)

    active = torch.arange(B, device=dev)  # original index of each sentence still searching
    hist = torch.full((B, 1, 1), cfg.bos_id, dtype=torch.long, device=dev)  # (b, k, t+1) with BOS
    scores = torch.zeros((B, 1), device=dev)  # (b, k) cumulative log P
    cache = model.new_cache() if incremental else None
    lp = length_penalty(torch.arange(1, T + 2, device=dev), alpha).to(dev)  # lp[t] for |Y| = t + 1
    for t in range(T + 1):  # step t picks the t-th output token (t = T: only EOS is left)
        b, k = hist.shape[:2]
        if incremental:
            logits = model.decode(hist[:, :, -1].reshape(b * k, 1), memory, src_pad_mask, cache)[:, -1]
        else:
            logits = model.decode(hist.reshape(b * k, t + 1), memory, src_pad_mask)[:, -1]
        lprobs = torch.log_softmax(logits.float(), dim=-1).view(b, k, V)  # (b, k, V)
        if t == 0:
            # One row per sentence so far; now K beams, of which only the first may extend at step 0.
            # memory and src_pad_mask keep one row per sentence.
            expand = torch.arange(b, device=dev).repeat_interleave(K)  # (b*K,)
            if cache is not None:
                cache.reorder(expand)
            lprobs = lprobs.expand(b, K, V).contiguous()
            hist = hist.expand(b, K, 1)
            scores = torch.full((b, K), NEG_INF, device=dev)
            scores[:, 0] = 0.0
            k = K
        _constrain_(lprobs, cfg, t, max_len[active], min_len)
        cand = (scores[:, :, None] + lprobs).view(b, k * V)  # (b, K·V)
        top_score, top_idx = cand.topk(min(2 * K, k * V), dim=1)  # (b, 2K), sorted
        top_beam, top_tok = top_idx // V, top_idx % V
        is_eos = top_tok.eq(cfg.eos_id) & top_score.gt(NEG_INF)

        # -- finish: EOS candidates ranked within the first K go to the pool --------------------
        fin = is_eos[:, :K]  # (b, K)
        n_finished[active] += fin.sum(dim=1)
        fin_logp = top_score[:, :K].masked_fill(~fin, NEG_INF)
        fin_tok = torch.full((b, K, T), cfg.pad_id, dtype=torch.long, device=dev)
        fin_tok[:, :, :t] = hist.gather(1, top_beam[:, :K, None].expand(b, K, t + 1))[:, :, 1:]
        _merge_pool(active, fin_logp / lp[t], fin_logp, torch.full_like(top_beam[:, :K], t), fin_tok,
                    pool_score, pool_logp, pool_len, pool_tok, K)

        # -- continue: the K best non-EOS candidates (stable sort keeps their score order) ------
        keep = torch.sort(is_eos.int(), dim=1, stable=True).indices[:, :K]  # (b, K)
        beam_src = top_beam.gather(1, keep)  # (b, K)
        scores = top_score.gather(1, keep)
        hist = torch.cat([hist.gather(1, beam_src[:, :, None].expand(b, K, t + 1)),
                          top_tok.gather(1, keep)[:, :, None]], dim=2)  # (b, K, t + 2)
        rows = (torch.arange(b, device=dev)[:, None] * K + beam_src).view(-1)  # (b·K,)

        done = n_finished[active].ge(K) | max_len[active].le(t) | scores[:, 0].eq(NEG_INF)
        if done.all():
            break
        still = None
        if done.any():
            still = (~done).nonzero().squeeze(1)  # (b',)
            hist, scores, active = hist[still], scores[still], active[still]
            rows = rows.view(b, K)[still].view(-1)
            memory, src_pad_mask = memory[still], src_pad_mask[still]
        if cache is not None:
            cache.reorder(rows, sources=still)
    return _nbest_lists(pool_score, pool_logp, pool_len, pool_tok, nbest)


def _constrain_(lprobs: torch.Tensor, cfg, t: int, max_len: torch.Tensor, min_len: int) -> None:
    # In place. lprobs: (b, K, V); max_len: (b,). Never PAD or BOS; no EOS before min_len tokens
    # (unless max_len comes first); only EOS once max_len tokens have been produced.
    lprobs[:, :, [cfg.pad_id, cfg.bos_id]] = NEG_INF
    eos = lprobs[:, :, cfg.eos_id]  # (b, K), a view
    if t < min_len:
        eos.masked_fill_(max_len.gt(t)[:, None], NEG_INF)
    at_max = max_len.le(t)  # (b,)
    if bool(at_max.any()):
        keep = eos.clone()
        lprobs.masked_fill_(at_max[:, None, None], NEG_INF)
        lprobs[:, :, cfg.eos_id] = torch.where(at_max[:, None], keep, lprobs[:, :, cfg.eos_id])


def _merge_pool(active, new_score, new_logp, new_len, new_tok, pool_score, pool_logp, pool_len,
                pool_tok, K) -> None:
    # Keep, per sentence, the K best of (pool ∪ newly finished) by normalised score.
    score = torch.cat([pool_score[active], new_score], dim=1)  # (b, 2K)
    best = score.topk(K, dim=1).indices  # (b, K)
    pool_score[active] = score.gather(1, best)
    pool_logp[active] = torch.cat([pool_logp[active], new_logp], dim=1).gather(1, best)
    pool_len[active] = torch.cat([pool_len[active], new_len], dim=1).gather(1, best)
    toks = torch.cat([pool_tok[active], new_tok], dim=1)  # (b, 2K, T)
    pool_tok[active] = toks.gather(1, best[:, :, None].expand(-1, -1, toks.size(2)))


def _nbest_lists(pool_score, pool_logp, pool_len, pool_tok, nbest) -> list[list[dict]]:
    order = pool_score.argsort(dim=1, descending=True, stable=True)[:, :nbest]  # pool is sorted; be sure
    out = []
    for s, lpb, n, toks in zip(pool_score.gather(1, order).tolist(), pool_logp.gather(1, order).tolist(),
                               pool_len.gather(1, order).tolist(),
                               pool_tok.gather(1, order[:, :, None].expand(-1, -1, pool_tok.size(2))).tolist()):
        out.append([{"tokens": tk[:m], "score": sc, "logprob": lg}
                    for sc, lg, m, tk in zip(s, lpb, n, toks) if sc > NEG_INF])
    return out
