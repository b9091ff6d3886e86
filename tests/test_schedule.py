import math

import pytest

from normlab.schedule import inverse_sqrt_factor, peak_lr


def paper_lr(step, d_model, warmup, scale=1.0):
    # Vaswani et al. 2017, eq. (3): lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


@pytest.mark.parametrize("step", [1, 10, 1000, 3999, 4000, 4001, 10000, 100000])
def test_matches_paper_formula(step):
    d, w = 512, 4000
    lr = peak_lr(d, w, lr=None) * inverse_sqrt_factor(step, w)
    assert lr == pytest.approx(paper_lr(step, d, w), rel=1e-12)


def test_known_values():
    # At step == warmup the paper's lr for base (d=512, warmup=4000) is 512^-0.5 * 4000^-0.5.
    assert peak_lr(512, 4000, None) == pytest.approx(6.987712429686844e-04)
    assert inverse_sqrt_factor(4000, 4000) == 1.0
    assert inverse_sqrt_factor(16000, 4000) == pytest.approx(0.5)
    assert inverse_sqrt_factor(1, 4000) == pytest.approx(1 / 4000)


def test_explicit_peak_and_no_warmup():
    assert peak_lr(128, 150, lr=3e-3) == 3e-3
    assert inverse_sqrt_factor(4, 0) == pytest.approx(0.5)
    assert inverse_sqrt_factor(75, 150) == pytest.approx(0.5)
    assert inverse_sqrt_factor(600, 150) == pytest.approx(math.sqrt(150 / 600))
