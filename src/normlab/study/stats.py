"""The uncertainty of a difference between two arms of a study.

Two intervals, both for mean(A) - mean(B) over seeds that both arms ran (the same seed gives both
arms the same batch order, so seeds are paired):

- `t`: Student's t over the paired seed differences, mean ± t_{0.975, n-1} · sd / √n. It measures
  the seed-to-seed spread only and needs n >= 2 (with 2 seeds t_{0.975,1} = 12.7: wide).
- `bootstrap` (corpus metrics: BLEU): paired bootstrap over test sentences and seeds (Koehn 2004's
  paired bootstrap, extended to seeds as a two-level resampling). Each replicate draws the seeds
  with replacement and the test sentences with replacement (the same sentences for both arms and
  every seed), recomputes corpus BLEU of every drawn run from summed per-sentence n-gram
  statistics, and takes the mean paired difference; the interval is the 2.5 / 97.5 percentiles.
  It measures the test set's sampling error and, coarsely with 2-3 seeds, the seeds' spread.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# t_{0.975, df} for df = 1..30 (two-sided 95%); above 30 the normal 1.96 is within 2%.
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788,
        2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639,
        2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t975(df: int) -> float:
    return T975[df - 1] if df <= len(T975) else 1.96


@dataclass(frozen=True)
class Interval:
    diff: float          # the observed mean paired difference A - B
    low: float | None    # the 95% interval (None: cannot be computed, e.g. one seed for t)
    high: float | None
    method: str          # "t over N paired seeds" / "bootstrap over sentences and N paired seeds (B draws)"
    n: int               # paired seeds


def paired_t(a: list[float], b: list[float]) -> Interval:
    """95% t interval of mean(a_i - b_i) over paired seeds."""
    d = np.asarray(a, float) - np.asarray(b, float)
    n = len(d)
    mean = float(d.mean()) if n else float("nan")
    if n < 2:
        return Interval(mean, None, None, f"t over {n} paired seed(s): needs 2", n)
    half = t975(n - 1) * float(d.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, f"t over {n} paired seeds", n)


# ---------------------------------------------------------------- BLEU from sufficient statistics
# One row per sentence: [hyp_len, ref_len, correct_1..4, total_1..4] (sacreBLEU's statistics, 13a).

def sentence_stats(hyps: list[str], refs: list[str]) -> np.ndarray:
    """(S, 10) BLEU statistics per sentence, from sacreBLEU's own n-gram counting."""
    import logging

    from sacrebleu.metrics import BLEU

    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    bleu = BLEU()  # corpus BLEU's settings (13a, exp smoothing): the statistics are the corpus score's
    out = np.zeros((len(hyps), 10), dtype=np.float64)
    quiet = logging.getLogger("sacrebleu")  # its per-sentence advice on effective_order: not for corpus stats
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for i, (h, r) in enumerate(zip(hyps, refs)):
            s = bleu.sentence_score(h, [r])
            out[i] = [s.sys_len, s.ref_len, *s.counts, *s.totals]
    finally:
        quiet.setLevel(level)
    return out


def corpus_bleu(stats: np.ndarray) -> np.ndarray:
    """Corpus BLEU of summed statistics (..., 10), as sacreBLEU computes it (smooth_method 'exp':
    a zero n-gram precision counts as 1 / 2^k of its total, k the number of zeros so far)."""
    stats = np.asarray(stats, dtype=np.float64)
    sys_len, ref_len = stats[..., 0], stats[..., 1]
    correct, total = stats[..., 2:6], stats[..., 6:10]
    zeros = np.cumsum(correct == 0, axis=-1)
    smoothed = np.where(correct == 0, 1.0 / np.power(2.0, zeros), correct)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.where(total > 0, np.log(smoothed) - np.log(np.where(total > 0, total, 1)), -np.inf)
        bp = np.where(sys_len >= ref_len, 1.0, np.exp(1.0 - ref_len / np.where(sys_len > 0, sys_len, 1)))
        bleu = bp * np.exp(logp.mean(axis=-1)) * 100.0
    return np.where((sys_len > 0) & np.all(total > 0, axis=-1), bleu, 0.0)


def paired_bootstrap(a: list[np.ndarray], b: list[np.ndarray], draws: int = 2000, seed: int = 12345) -> Interval:
    """95% interval of the mean paired corpus-BLEU difference A - B; a[i], b[i]: (S, 10) statistics
    of seed i's run of each arm on the same S test sentences."""
    n = len(a)
    if n == 0 or n != len(b):
        return Interval(float("nan"), None, None, "bootstrap: no paired seeds", 0)
    A, B = np.stack(a), np.stack(b)  # (n, S, 10)
    observed = float((corpus_bleu(A.sum(1)) - corpus_bleu(B.sum(1))).mean())
    rng = np.random.default_rng(seed)
    S = A.shape[1]
    diffs = np.empty(draws)
    chunk = 250
    for start in range(0, draws, chunk):
        m = min(chunk, draws - start)
        counts = rng.multinomial(S, np.full(S, 1.0 / S), size=m).astype(np.float64)  # (m, S) sentence draws
        bleu_a = corpus_bleu(np.einsum("ms,nsk->mnk", counts, A))  # (m, n): every seed on this sample
        bleu_b = corpus_bleu(np.einsum("ms,nsk->mnk", counts, B))
        pick = rng.integers(0, n, size=(m, n))  # seeds drawn with replacement, the pair kept together
        d = np.take_along_axis(bleu_a - bleu_b, pick, axis=1)
        diffs[start:start + m] = d.mean(axis=1)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return Interval(observed, float(low), float(high),
                    f"bootstrap over {S} sentences and {n} paired seed(s), {draws} draws", n)
