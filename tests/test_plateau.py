"""plateau.plateau_step: the rule a run stops by and a study judges older records by (issue 35)."""
import math

import pytest

from normlab.plateau import plateau_step


def test_a_curve_that_keeps_falling_never_plateaus():
    steps = list(range(250, 2001, 250))
    assert plateau_step(steps, [5 - 0.1 * i for i in range(len(steps))], window=500, min_delta=0.05) is None


def test_the_first_step_whose_window_gained_less_than_min_delta():
    steps = [250, 500, 750, 1000, 1250, 1500]
    losses = [5.0, 4.0, 3.5, 3.49, 3.485, 3.48]
    # at 1000: best before 500 is 4.0, now 3.49 (gain 0.51); at 1250: 3.5 -> 3.485 (0.015 < 0.02)
    assert plateau_step(steps, losses, window=500, min_delta=0.02) == 1250
    assert plateau_step(steps, losses, window=500, min_delta=0.01) is None  # 0.015 and 0.02: still gaining
    assert plateau_step(steps, losses, window=250, min_delta=0.02) == 1000  # 3.5 -> 3.49


def test_a_noisy_last_value_or_a_rise_is_no_improvement_but_does_not_erase_one():
    steps = [100, 200, 300, 400]
    assert plateau_step(steps, [4.0, 3.0, 3.5, 2.0], window=200, min_delta=0.1) is None  # best 3.0 -> 2.0 at 400
    assert plateau_step(steps, [4.0, 3.0, 3.5, 3.4], window=200, min_delta=0.1) == 400   # 3.0 -> 3.0
    assert plateau_step(steps, [4.0, math.nan, math.inf, 3.0], window=100, min_delta=0.1) == 200


def test_limits():
    assert plateau_step([], [], window=100, min_delta=0.0) is None
    assert plateau_step([100], [1.0], window=100, min_delta=0.0) is None  # no window of history yet
    assert plateau_step([100, 200], [1.0, 1.0], window=100, min_delta=0.0) is None  # a gain of 0 is >= 0
    assert plateau_step([100, 200], [1.0, 1.0], window=100, min_delta=1e-9) == 200
    with pytest.raises(ValueError):
        plateau_step([1], [1.0], window=0, min_delta=0.1)
