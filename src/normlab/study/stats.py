"""The uncertainty of a difference between two arms of a study: the formulas the verdicts use.

Seed-level interval (decides every comparison's verdict; claims.py). For mean(A) − mean(B) over the
n seeds both arms ran (d̄ = the mean paired difference; the same seed gives both arms the same batch
order), each arm's seed-to-seed variance s² comes from a source k, with df_k degrees of freedom:
the arm's own seeds (s² = Σ_i (x_i − x̄)² / (n_arm − 1)), or, where the study puts arms in a regime
family, the variance pooled over the family's arms (`pooled_variance`):

    s²_F = Σ_arms Σ_seeds (x − x̄_arm)² / Σ_arms (n_arm − 1),      df_F = Σ_arms (n_arm − 1)

    SE² = Σ_k c_k s²_k + v_sent,   c_k = Σ over the claim's arms that use source k of 1 / n
    df  = (Σ_k c_k s²_k + v_sent)² / Σ_k (c_k s²_k)² / df_k          (Welch–Satterthwaite)
    interval: d̄ ± t_{0.975, df} · SE

Two arms of one family share one estimate (one term, c = 2 / n, df_F), so the df is not counted
twice. The arms' variances are taken as independent (the covariance of a seed's two runs is not
estimable from 2-3 seeds; seeds that move both arms alike make this conservative).

v_sent, the test sentences' share (BLEU claims judged with `interval: bootstrap`): the variance of
the mean paired difference over bootstrap resamples of the test sentences with the runs held fixed
(`paired_bootstrap`). It is added because every run is scored on the same sentences: the seeds'
spread cannot contain the sampling error of the test set, which a claim about the schemes (not
about these 1,000 sentences) must carry. It also holds the seed x sentence interaction that the
seeds' spread holds (a 1 / S share: counted twice, on the wide side). It has no df term (its
estimate rests on S sentences: df → ∞).

"Needs N seeds" (`seeds_needed`): the smallest N <= cap for which the same variances, with each
source's df grown by the claim arms' N − n new seeds and v_sent unchanged (it does not shrink with
seeds), give t_{0.975, df(N)} · SE(N) < the distance from d̄ to the claim's decision boundary.

Test-set check (`paired_bootstrap`, per run, shown beside the verdict, never deciding it): Koehn
2004's paired bootstrap over test sentences, the paired runs fixed: each replicate draws the S test
sentences with replacement (the same for both arms and every seed), recomputes each run's corpus
BLEU from summed per-sentence n-gram statistics, and takes the mean paired difference; the interval
is the 2.5 / 97.5 percentiles, `se` the replicates' sd (√v_sent). It says whether these runs'
difference survives the choice of test sentences, not whether another seed would repeat it.

A claim that compares two metrics of the same runs (a pruned model against its own full model) has
one variance, the paired differences' (df n − 1): the paired t interval, the pairing being the run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z975 = 1.959963984540054  # the normal's 97.5th percentile: t_{0.975, df -> inf}


@dataclass(frozen=True)
class Interval:
    diff: float          # the observed mean paired difference A - B
    low: float | None    # the 95% interval (None: cannot be computed, e.g. a variance not measured)
    high: float | None
    method: str          # how it was computed, in words
    n: int               # paired seeds
    df: float | None = None  # the t interval's degrees of freedom (Welch-Satterthwaite)
    se: float | None = None  # its standard error (the bootstrap: the replicates' sd)


@dataclass(frozen=True)
class Variance:
    """One arm's seed-to-seed variance of a metric, and where it came from."""
    s2: float | None     # None: not measured (one seed, and no family to pool it)
    df: int
    source: str          # the family's name, or the arm's own
    arms: tuple[str, ...] = ()  # the arms whose seeds estimated it
    why: str = ""        # why the arm uses its own variance in a family (variance.py)


# ---------------------------------------------------------------- t and F quantiles
# The regularized incomplete beta I_x(a, b) by its continued fraction (Numerical Recipes 6.4, the
# modified Lentz method): t and F quantiles at the fractional df Welch-Satterthwaite gives, without
# scipy (not a dependency); tests check them against scipy.

def betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast below this point: use the symmetry
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f


def _solve(increasing, target: float) -> float:
    """x in (0, 1) with increasing(x) = target, by bisection to 1e-17."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if increasing(mid) < target else (lo, mid)
        if hi - lo < 1e-17:
            break
    return (lo + hi) / 2


def t975(df: float) -> float:
    """t_{0.975, df}, df > 0 and fractional allowed: P(|T| > t) = 0.05 <=> I_{df/(df+t²)}(df/2, 1/2) = 0.05."""
    if df is None or math.isinf(df):
        return Z975
    x = _solve(lambda x: betainc(df / 2, 0.5, x), 0.05)
    return math.sqrt(df * (1 - x) / x)


def f_quantile(p: float, d1: float, d2: float) -> float:
    """The F(d1, d2) distribution's p quantile: P(F <= f) = I_{d1 f / (d1 f + d2)}(d1/2, d2/2)."""
    x = _solve(lambda x: betainc(d1 / 2, d2 / 2, x), p)
    return d2 * x / (d1 * (1 - x))


# ---------------------------------------------------------------- the seed-level interval

def pooled_variance(groups: list[list[float]]) -> tuple[float | None, int]:
    """(s², df): the within-group sum of squares over Σ (n_g − 1); a group of one adds nothing."""
    ss = sum(float(((np.asarray(g, float) - np.mean(g)) ** 2).sum()) for g in groups if len(g) > 1)
    df = sum(len(g) - 1 for g in groups if len(g) > 1)
    return (ss / df if df else None), df


def _se_df(n: int, variances: list[Variance], sentence_var: float, more: int = 0) -> tuple[float, float]:
    parts: dict[str, list[float]] = {}  # source -> [c_k s²_k, df_k]: one arm's source, or a family two arms share
    for v in variances:
        part = parts.setdefault(v.source, [0.0, float(v.df)])
        part[0] += v.s2 / n
        part[1] += more  # the claim's arm adds `more` seeds to its source
    se2 = sum(p[0] for p in parts.values()) + sentence_var
    denom = sum(p[0] ** 2 / p[1] for p in parts.values() if p[0] > 0)
    return math.sqrt(se2), (se2 ** 2 / denom if denom > 0 else math.inf)


def seed_interval(diff: float, n: int, variances: list[Variance], sentence_var: float = 0.0) -> Interval:
    """95% interval of mean(A) − mean(B) over n paired seeds from the claim's arms' seed variances
    (one per arm; one for the paired differences of two metrics of the same runs)."""
    what = f"t over {n} paired seed{'s' if n != 1 else ''}"
    if any(v.s2 is None for v in variances):
        return Interval(diff, None, None, f"{what}: a seed variance not measured (one seed, no family to pool it)", n)
    se, df = _se_df(n, variances, sentence_var)
    half = t975(df) * se
    return Interval(diff, diff - half, diff + half,
                    f"{what}, df {df:.1f}" + (" + test sentences" if sentence_var > 0 else ""), n, df, se)


def seeds_needed(distance: float, n: int, variances: list[Variance], sentence_var: float = 0.0,
                 cap: int = 10) -> int | None:
    """The fewest paired seeds (n < N <= cap) at which the same variances decide: t · SE(N) < distance."""
    if distance <= 0 or any(v.s2 is None for v in variances):
        return None
    for m in range(n + 1, cap + 1):
        se, df = _se_df(m, variances, sentence_var, more=m - n)
        if t975(df) * se < distance:
            return m
    return None


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
    """The test-set check: 95% interval of the mean paired corpus-BLEU difference A - B over test
    sentences, the runs fixed; a[i], b[i]: (S, 10) statistics of seed i's run of each arm on the same
    S test sentences. `se`: the replicates' sd (the seed interval's sentence share is se²)."""
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
        diffs[start:start + m] = (bleu_a - bleu_b).mean(axis=1)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return Interval(observed, float(low), float(high),
                    f"bootstrap over {S} test sentences, the {n} paired run{'s' if n != 1 else ''} fixed, {draws} draws",
                    n, se=float(diffs.std(ddof=1)))
