"""The study statistics against independent computations: corpus BLEU from summed per-sentence
statistics equals sacreBLEU's corpus score, the t interval equals scipy's, the paired bootstrap
behaves at its limits (identical arms, one arm strictly better, the arms swapped)."""
import math
import random

import numpy as np
import pytest
import sacrebleu

from normlab.study.stats import corpus_bleu, paired_bootstrap, paired_t, sentence_stats, t975

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


def test_paired_t_matches_scipy_and_formula():
    a, b = [27.1, 26.5, 27.9], [24.0, 24.8, 25.1]
    iv = paired_t(a, b)
    d = np.subtract(a, b)
    half = t975(2) * d.std(ddof=1) / math.sqrt(3)
    assert iv.diff == pytest.approx(d.mean()) and iv.low == pytest.approx(d.mean() - half)
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 29):
        assert t975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3)
    low, high = stats.t.interval(0.95, 2, loc=d.mean(), scale=stats.sem(d))
    assert (iv.low, iv.high) == pytest.approx((low, high), abs=1e-3)


def test_paired_t_needs_two_seeds():
    iv = paired_t([27.0], [25.0])
    assert iv.diff == 2.0 and iv.low is None and iv.high is None


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
