"""The study statistics against independent computations: corpus BLEU from summed per-sentence
statistics equals sacreBLEU's corpus score; t and F quantiles at fractional df equal scipy's; the
seed-level interval equals Welch's (scipy) without pooling and a hand computation with a family's
pooled variance; "needs N seeds" is the first N whose interval clears the boundary; the paired
bootstrap behaves at its limits (identical arms, one arm strictly better, the arms swapped)."""
import math
import random

import numpy as np
import pytest
import sacrebleu

from normlab.study.stats import (Variance, corpus_bleu, f_quantile, paired_bootstrap, pooled_variance, seed_interval,
                                 seeds_needed, sentence_stats, t975)

REFS = [
    "In the beginning God created the heavens and the earth .",
    "The earth was without form and void , and darkness was over the face of the deep .",
    "And God said , Let there be light , and there was light .",
    "And God saw that the light was good .",
    "God called the light Day , and the darkness he called Night .",
    "And there was evening and there was morning , the first day .",
] * 5


def degrade(refs, drop, seed):
    rng = random.Random(seed)
    return [" ".join(w for w in r.split() if rng.random() > drop) for r in refs]


@pytest.mark.parametrize("drop", [0.0, 0.2, 0.6, 0.95])
def test_corpus_bleu_from_sentence_stats_is_sacrebleu(drop):
    hyps = degrade(REFS, drop, seed=3)
    stats = sentence_stats(hyps, REFS)
    assert corpus_bleu(stats.sum(0)) == pytest.approx(sacrebleu.corpus_bleu(hyps, [REFS]).score, abs=1e-9)
    idx = [1, 1, 4, 7, 9, 22, 22, 22, 5]  # a bootstrap-like sample with repeats
    sub_h, sub_r = [hyps[i] for i in idx], [REFS[i] for i in idx]
    assert corpus_bleu(stats[idx].sum(0)) == pytest.approx(sacrebleu.corpus_bleu(sub_h, [sub_r]).score, abs=1e-9)


def test_corpus_bleu_degenerate_outputs():
    # zero 3-gram and 4-gram matches (exp smoothing), and empty output (BLEU 0), as sacreBLEU
    for hyps in (["God"] * len(REFS), ["the light God"] * len(REFS), [""] * len(REFS)):
        stats = sentence_stats(hyps, REFS)
        assert corpus_bleu(stats.sum(0)) == pytest.approx(sacrebleu.corpus_bleu(hyps, [REFS]).score, abs=1e-9)


def test_t_and_f_quantiles_match_scipy_at_fractional_df():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 1.08, 1.5, 2, 2.7, 4.93, 7.3, 29, 45, 1000):
        assert t975(df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-9)
    assert t975(math.inf) == pytest.approx(stats.norm.ppf(0.975), rel=1e-12)
    for d1, d2 in ((1, 1), (1, 3), (2, 2), (2, 7), (3, 40)):
        assert f_quantile(0.95, d1, d2) == pytest.approx(stats.f.ppf(0.95, d1, d2), rel=1e-9)


A3, B3, C2 = [27.0, 27.4, 26.8], [24.0, 24.5, 23.9], [20.0, 20.6]


def test_without_pooling_the_seed_interval_is_welchs():
    """Each arm alone (no family): Welch's unequal-variance t interval, df by Welch-Satterthwaite."""
    stats = pytest.importorskip("scipy.stats")
    va, vb = (Variance(*pooled_variance([x]), source=f"arm:{k}") for k, x in (("a", A3), ("b", B3)))
    iv = seed_interval(float(np.mean(A3) - np.mean(B3)), 3, [va, vb])
    welch = stats.ttest_ind(A3, B3, equal_var=False)
    assert iv.df == pytest.approx(welch.df, rel=1e-9)
    assert (iv.low, iv.high) == pytest.approx(tuple(welch.confidence_interval(0.95)), rel=1e-9)


def test_a_family_pools_its_arms_seed_variance_by_hand():
    """Arm a (3 seeds) pooled with c (2 seeds) in one family, b alone; worked by hand:
    SS_a = 0.56/3 (deviations -1/15, 1/3, -4/15), SS_c = 0.18 (±0.3), s²_F = (0.56/3 + 0.18) / (2 + 1)
    = 11/90 on 3 df; s²_b = 0.62/3 / 2 = 31/300 on 2 df; SE² = s²_F/3 + s²_b/3;
    df = SE⁴ / ((s²_F/3)²/3 + (s²_b/3)²/2) = 4.93."""
    stats = pytest.importorskip("scipy.stats")
    s2_f, df_f = pooled_variance([A3, C2])
    assert (s2_f, df_f) == (pytest.approx(11 / 90), 3)
    fam, own = Variance(s2_f, df_f, "family:F", ("a", "c")), Variance(*pooled_variance([B3]), source="arm:b")
    assert own.s2 == pytest.approx(31 / 300) and own.df == 2
    diff = 81.2 / 3 - 72.4 / 3
    iv = seed_interval(diff, 3, [fam, own])
    se2 = 11 / 90 / 3 + 31 / 300 / 3
    df = se2 ** 2 / ((11 / 90 / 3) ** 2 / 3 + (31 / 300 / 3) ** 2 / 2)
    assert iv.df == pytest.approx(df) and round(iv.df, 2) == 4.93
    half = stats.t.ppf(0.975, df) * math.sqrt(se2)
    assert (iv.diff, iv.low, iv.high, iv.se) == pytest.approx((diff, diff - half, diff + half, math.sqrt(se2)))
    assert iv.method == "t over 3 paired seeds, df 4.9"
    # the test sentences' variance adds to SE² with no df term (its estimate rests on the sentences)
    with_sent = seed_interval(diff, 3, [fam, own], sentence_var=0.05)
    assert with_sent.se == pytest.approx(math.sqrt(se2 + 0.05)) and with_sent.df == pytest.approx(
        (se2 + 0.05) ** 2 / ((11 / 90 / 3) ** 2 / 3 + (31 / 300 / 3) ** 2 / 2))
    assert with_sent.method.endswith("+ test sentences")


def test_two_arms_of_one_family_share_one_estimate_and_its_df():
    """Both arms pooled in one family: one variance estimate, SE² = s²_F (1/n + 1/n) on df_F, not
    Welch-Satterthwaite's 2 df_F (that would count the same seeds twice)."""
    stats = pytest.importorskip("scipy.stats")
    fam = Variance(0.5, 4, "family:F", ("a", "b"))
    iv = seed_interval(1.0, 2, [fam, fam])
    assert iv.df == pytest.approx(4) and iv.high - 1.0 == pytest.approx(stats.t.ppf(0.975, 4) * math.sqrt(0.5))


def test_one_seed_without_a_family_has_no_interval():
    iv = seed_interval(2.0, 1, [Variance(None, 0, "arm:a"), Variance(None, 0, "arm:b")])
    assert iv.low is None and "not measured" in iv.method
    assert seeds_needed(2.0, 1, [Variance(None, 0, "arm:a"), Variance(None, 0, "arm:b")]) is None
    fam = Variance(0.1, 4, "family:F")  # a family measures it for one seed
    assert seed_interval(2.0, 1, [fam, fam]).low is not None


def test_seeds_needed_is_the_first_n_whose_interval_clears_the_boundary():
    """a: 21, 23 (s² 2, df 1), b: 20, 20.4 (s² 0.08, df 1), difference 1.8: inconclusive at 2 seeds;
    at N seeds each arm's df is N - 1 and SE² = (2 + 0.08) / N: by hand with scipy's t the half width
    is 2.20 at N = 4 and 1.75 at N = 5, so N = 5; a difference of 0.5 needs more than 10."""
    stats = pytest.importorskip("scipy.stats")
    va, vb = Variance(2.0, 1, "arm:a"), Variance(0.08, 1, "arm:b")

    def half(n):
        se2 = (2.0 + 0.08) / n
        df = se2 ** 2 / ((2.0 / n) ** 2 / (n - 1) + (0.08 / n) ** 2 / (n - 1))
        return stats.t.ppf(0.975, df) * math.sqrt(se2)

    assert half(2) > 1.8 and half(4) > 1.8 > half(5)
    assert seed_interval(1.8, 2, [va, vb]).low < 0
    assert seeds_needed(1.8, 2, [va, vb]) == 5
    assert seeds_needed(0.5, 2, [va, vb]) is None and seeds_needed(0.5, 2, [va, vb], cap=100) > 10
    # a sentence variance that alone keeps the interval over the boundary: no N decides it
    assert seeds_needed(1.8, 2, [va, vb], sentence_var=1.0) is None
    assert seeds_needed(0.0, 2, [va, vb]) is None  # on the boundary: nothing decides it


def test_bootstrap_limits():
    good = [sentence_stats(degrade(REFS, 0.1, s), REFS) for s in (1, 2)]
    bad = [sentence_stats(degrade(REFS, 0.5, s), REFS) for s in (1, 2)]
    same = paired_bootstrap(good, good, draws=400)
    assert same.diff == 0 and same.low == 0 and same.high == 0  # every replicate pairs a run with itself
    better = paired_bootstrap(good, bad, draws=400)
    assert better.low > 0 and better.low <= better.diff <= better.high
    worse = paired_bootstrap(bad, good, draws=400)
    assert worse.diff == pytest.approx(-better.diff)
    assert worse.high < 0
    # the observed difference is the mean over seeds of corpus BLEU differences
    expected = np.mean([corpus_bleu(g.sum(0)) - corpus_bleu(b.sum(0)) for g, b in zip(good, bad)])
    assert better.diff == pytest.approx(expected)
    assert paired_bootstrap(good, bad, draws=400) == better  # seeded: the same interval every time
    assert "the 2 paired runs fixed" in better.method and better.se > 0 and same.se == 0


def test_the_bootstrap_holds_the_runs_fixed():
    """The test-set check resamples sentences only: two seeds whose differences are 0 and a large
    gain give an interval around their mean, narrow as one run's, never the spread of the seeds
    (a resampled pair of seeds would put some replicates at 0 and some at the gain)."""
    good, bad = sentence_stats(degrade(REFS, 0.1, 1), REFS), sentence_stats(degrade(REFS, 0.7, 1), REFS)
    one = paired_bootstrap([good], [bad], draws=400)
    two = paired_bootstrap([good, bad], [bad, bad], draws=400)  # seed 2: the same run on both sides
    assert two.diff == pytest.approx(one.diff / 2)
    assert (two.low, two.high) == pytest.approx((one.low / 2, one.high / 2), rel=1e-9)
