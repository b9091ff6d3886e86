"""The `fewer_steps` claim (study/fewer_steps.py; nGPT's "fewer steps to the same accuracy") against hand
computations on synthetic records: per-seed speed-ups from metrics.csv curves (linear between
validations), held / contradicted / inconclusive on the t interval of the log speed-ups against
log(margin), A never reaching B's loss, budget-bound, one seed; its spec refusals, fixed definition,
and its cells in the claims table and the index."""
import json
import math

import pytest

from normlab.errors import UserError
from normlab.study.claims import judge
from normlab.study.fixed import definition, definition_hash
from normlab.study.records import load_records
from normlab.study.spec import load_study
from normlab.study.verdict_text import claims_lines, index_row

from study_files import write_study_file

CLAIM = {"id": "fast", "claim": "A reaches B's loss in fewer steps", "source": "s", "paper": "p", "kind": "fewer_steps",
         "better": "a", "than": "b1", "margin": 1.5}
PLATEAU = "plateau: {window: 1000, min_delta: 0.01, cap: 2500}\n"
T2, T4 = 4.302652729911275, 2.7764451051977987  # t_{0.975, 2}, t_{0.975, 4} (tables)
# B: validations after 500, 1000, ... 2500 steps (metrics.csv steps 499, 999, ...), its last at 3.0:
# steps_B = 2500
B_CURVE = [(499, 5.0), (999, 4.0), (1499, 3.5), (1999, 3.2), (2499, 3.0)]


def a_curve(steps: float, last: int = 2499) -> list:
    """An A curve that crosses 3.0 (B's last) after exactly `steps` steps, linear between validations:
    0.4 nats per 500 steps around the crossing, 0.5 apart before it."""
    x = steps - 1  # the 0-based step of the crossing
    s1 = 499 + 500 * math.ceil((x - 499) / 500)  # the first validation at or after it
    f = (x - (s1 - 500)) / 500  # where in (s1 - 500, s1] it crosses
    points = {s1 - 500: 3.0 + 0.4 * f, s1: 3.0 - 0.4 * (1 - f)}
    for s in range(499, last + 1, 500):
        if s < s1 - 500:
            points[s] = 3.0 + 0.4 * f + 0.5 * (s1 - 500 - s) / 500
        elif s > s1:
            points[s] = points[s1] - 0.01 * (s - s1) / 500
    return sorted((s, v) for s, v in points.items() if 0 <= s <= last)


def run(out, arm, seed, points, status="completed", plateau=1999):
    """A record with its metrics.csv (train rows between the validations) and results.json (`plateau`:
    the step of its plateau, None: still improving when it stopped)."""
    d = out / "runs" / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"status": status, "study": {"arm": arm, "seed": seed},
                                                "steps": points[-1][0] + 1 if points else 0,
                                                "plateau": {"step": plateau, "cap": 2500}}))
    rows = ["step,train/loss,valid/loss"] + [f"{s - 10},6.0," for s, _ in points] + [f"{s},,{v!r}" for s, v in points]
    (d / "metrics.csv").write_text("\n".join(rows) + "\n")


def judged(tmp_path, a_curves: list, b_curves=None, claims=(CLAIM,), extra=PLATEAU, a_plateau=1999, b_plateau=1999):
    study = load_study(str(write_study_file(tmp_path, list(claims), extra=extra)))
    out = tmp_path / "out"
    for seed, points in enumerate(a_curves, 1):
        if points is not None:
            run(out, "a", seed, points, plateau=a_plateau)
    for seed, points in enumerate(b_curves or [B_CURVE] * len(a_curves), 1):
        if points is not None:
            run(out, "b1", seed, points, plateau=b_plateau)
    return {v.claim.id: v for v in judge(study, load_records(out), None)}["fast"]


def t_interval(speedups, t):
    logs = [math.log(x) for x in speedups]
    n, mean = len(logs), sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    return mean, mean - t * sd / math.sqrt(n), mean + t * sd / math.sqrt(n)


def test_a_seeds_speed_up_is_b_steps_over_a_steps_to_b_last_loss_linear_between_validations(tmp_path):
    # B at 3.0 by step 1499, up to 3.05 and back to 3.0 at its last: steps_B = 1500 (its first time at
    # its last loss; the plateau's tail is not B's). A: 3.4 after 500 steps, 2.6 after 1000: it crosses
    # 3.0 half way, after 750 steps: 1500 / 750 = 2.0
    b = [(499, 5.0), (999, 4.0), (1499, 3.0), (1999, 3.05), (2499, 3.0)]
    v = judged(tmp_path / "1", [[(499, 3.4), (999, 2.6), (1499, 2.5)]], [b])
    r = v.speedup["seeds"][1]
    assert (r["state"], r["target"], r["steps_b"], r["steps_a"]) == ("reached", 3.0, 1500, 750)
    assert r["speedup"] == pytest.approx(2.0)
    # A below 3.0 at its first validation: 500 steps is an upper bound, 1500 / 500 = 3 a lower bound
    v = judged(tmp_path / "2", [[(499, 2.9), (999, 2.6)]], [b])
    r = v.speedup["seeds"][1]
    assert (r["state"], r["steps_a"], r["speedup"]) == ("first", 500, 3.0) and "s1 ×≥3.00" in v.note
    # the curve helper crosses where it says: 2500 / 1250 = 2.0, 2500 / 1562.5 = 1.6
    for steps in (1250, 1562.5, 1000, 2500):
        assert judged(tmp_path / f"h{steps}", [a_curve(steps)]).speedup["seeds"][1]["steps_a"] == pytest.approx(steps)


def test_held_when_the_log_speed_ups_interval_lies_at_or_above_log_margin(tmp_path):
    # steps_A 1250, 1000, 1000 of 2500: ×2.0, 2.5, 2.5; logs 0.693, 0.916, 0.916: mean 0.842, sd 0.129,
    # t(2) 4.303 x se 0.0744 = 0.320: [0.522, 1.162], above log 1.5 = 0.405
    v = judged(tmp_path, [a_curve(1250), a_curve(1000), a_curve(1000)])
    mean, low, high = t_interval([2.0, 2.5, 2.5], T2)
    assert v.verdict == "held" and v.interval.n == 3 and v.interval.df == pytest.approx(2)
    assert (v.interval.diff, v.interval.low, v.interval.high) == (pytest.approx(mean), pytest.approx(low),
                                                                 pytest.approx(high))
    assert low == pytest.approx(0.522, abs=1e-3) and low > math.log(1.5)
    c = json.loads(json.dumps(v.as_dict()))  # as claims.json holds it
    assert c["margin"] == 1.5 and c["fewer_steps"]["seeds"]["1"]["speedup"] == pytest.approx(2.0)
    cell = f"speed-up ×{math.exp(mean):.2f} [{math.exp(low):.2f}, {math.exp(high):.2f}] (s1 ×2.00, s2 ×2.50, s3 ×2.50)"
    assert cell == "speed-up ×2.32 [1.69, 3.20] (s1 ×2.00, s2 ×2.50, s3 ×2.50)"
    row = next(line for line in claims_lines([c]) if line.startswith("| A reaches"))
    assert row == (f"| A reaches B's loss in fewer steps (a vs b1, steps to b1's last valid_loss) | s | p | {cell} | — "
                   "| **held** |")
    assert index_row("s", "s", c).endswith(f"| {cell} | t on log speed-ups, 3 seeds, df 2.0; margin ×1.5 | **held** |")


def test_a_speed_up_of_exactly_the_margin_holds(tmp_path):
    # B at its last 3.0 after 1500 steps, A after 1000 on both seeds: ×1.5 each, no spread: the interval
    # is the point log 1.5, "at least the margin" (an interval at or above log(margin) holds)
    b = B_CURVE[:2] + [(1499, 3.0)]
    v = judged(tmp_path, [a_curve(1000, last=1499)] * 2, [b] * 2)
    assert [r["speedup"] for r in v.speedup["seeds"].values()] == [1.5, 1.5]
    assert v.interval.low == v.interval.high == math.log(1.5) and v.verdict == "held"


def test_contradicted_when_the_interval_lies_below_log_margin_and_inconclusive_between(tmp_path):
    # ×1.0, 1.25, 1.0: logs 0, 0.223, 0: mean 0.074, upper 0.074 + 4.303 x 0.0744 = 0.394 < 0.405
    v = judged(tmp_path / "1", [a_curve(2500), a_curve(2000), a_curve(2500)])
    mean, low, high = t_interval([1.0, 1.25, 1.0], T2)
    assert high == pytest.approx(0.394, abs=1e-3) and v.interval.high == pytest.approx(high)
    assert v.verdict == "contradicted"
    # ×2.0, 1.6, 2.5: logs 0.693, 0.470, 0.916, mean 0.693, sd 0.223: [0.139, 1.247] holds log 1.5; at the
    # same sd 5 seeds give t(4) 2.776 x 0.223 / √5 = 0.277 < 0.693 - 0.405 = 0.288 (4: 3.182 x 0.1115 = 0.355)
    v = judged(tmp_path / "2", [a_curve(1250), a_curve(1562.5), a_curve(1000)])
    mean, low, high = t_interval([2.0, 1.6, 2.5], T2)
    sd = (high - mean) / T2 * math.sqrt(3)
    assert low < math.log(1.5) < high and T4 * sd / math.sqrt(5) < mean - math.log(1.5) < 3.182446 * sd / 2
    assert v.verdict == "inconclusive (needs 5 seeds)" and v.needs == 5


def test_a_that_never_reaches_b_loss_contradicts_it_on_that_seed(tmp_path):
    above = [(499, 4.0), (999, 3.5), (1499, 3.3), (1999, 3.29), (2499, 3.29)]  # plateaued above 3.0
    v = judged(tmp_path / "1", [above, above, above])
    assert v.verdict == "contradicted" and v.interval is None
    assert [r["state"] for r in v.speedup["seeds"].values()] == ["never"] * 3
    assert v.speedup["seeds"][1]["bound"] == pytest.approx(1.0)  # 2500 / 2500: below the margin whatever it did next
    assert "s1 never (×<1.00)" in v.note and "a never reached the target on seeds 1, 2, 3" in v.note
    # run to the cap still improving (results.json plateau step None): 2500 steps without B's loss is
    # already below ×1.5, so it contradicts, not budget-bound
    assert judged(tmp_path / "2", [above] * 3, a_plateau=None).verdict == "contradicted"
    # one seed never, two fast: never held (the seeds that reached it alone would hold it)
    v = judged(tmp_path / "3", [a_curve(1000), a_curve(1000), above])
    assert v.verdict == "inconclusive" and v.needs is None
    # one never, two whose own interval lies below log 1.5: contradicted (the third lies below too)
    v = judged(tmp_path / "4", [a_curve(2500), a_curve(2400), above])
    assert v.interval.n == 2 and v.interval.high < math.log(1.5) and v.verdict == "contradicted"


def test_a_lower_bound_below_the_margin_does_not_contradict(tmp_path):
    # B at its last 3.0 after 1000 steps; A validated first after 800, already at 2.9: ×1000 / 800 = 1.25
    # is a lower bound (A may have been there much sooner), so it cannot say A was slower than ×1.5
    b, a = [(499, 5.0), (999, 3.0)], [(799, 2.9), (1599, 2.8)]
    v = judged(tmp_path, [a, a], [b, b])
    assert [r["state"] for r in v.speedup["seeds"].values()] == ["first", "first"]
    assert v.interval.high == pytest.approx(math.log(1.25)) and v.verdict == "inconclusive" and v.needs is None
    assert "its speed-up there a lower bound" in v.note


def test_budget_bound_when_a_stopped_early_still_improving(tmp_path):
    short = [(499, 4.0), (999, 3.6)]  # 1000 steps, above 3.0: ×< 2500 / 1000 = 2.5, which could still be >= 1.5
    v = judged(tmp_path / "1", [a_curve(1000), a_curve(1000), short], a_plateau=None)
    assert v.verdict == "budget-bound" and v.speedup["seeds"][3]["state"] == "budget-bound"
    assert "s3 budget-bound (×<2.50)" in v.note
    # the same run stopped at its plateau: it will not get there: contradicts on that seed
    v = judged(tmp_path / "2", [a_curve(1000), a_curve(1000), short], a_plateau=499)
    assert v.speedup["seeds"][3]["state"] == "never" and v.verdict == "inconclusive"
    # without the study's plateau rule nothing is known to be improving: never, not budget-bound
    assert judged(tmp_path / "3", [short, short], a_plateau=None, extra="").verdict == "contradicted"


def test_b_still_improving_at_its_cap_sets_the_target_where_it_stopped(tmp_path):
    # the claim is judged at B's budget (the paper's baseline ran to its budget too): not budget-bound
    v = judged(tmp_path, [a_curve(1250), a_curve(1000), a_curve(1000)], b_plateau=None)
    assert v.verdict == "held" and "b1 still improving when it stopped on seeds 1, 2, 3: the target is its " \
        "valid_loss there (at its budget)" in v.note
    assert "still improving" not in judged(tmp_path / "p", [a_curve(1250), a_curve(1000)]).note


def test_one_paired_seed_needs_two(tmp_path):
    v = judged(tmp_path / "1", [a_curve(1000)])
    assert v.verdict == "inconclusive (needs 2 seeds)" and v.needs == 2 and v.interval.low is None
    assert "one paired seed" in v.note
    # even when it never reached the loss: one seed decides nothing
    above = [(499, 4.0), (999, 3.5), (1499, 3.3), (1999, 3.29), (2499, 3.29)]
    assert judged(tmp_path / "2", [above]).verdict == "inconclusive (needs 2 seeds)"
    # the seeds both arms completed are paired: a's seed 2 diverged, b1's seed 3 not run
    study = load_study(str(write_study_file(tmp_path / "3", [CLAIM], extra=PLATEAU)))
    out = tmp_path / "3" / "out"
    run(out, "a", 1, a_curve(1000)), run(out, "a", 2, a_curve(1000), status="diverged"), run(out, "a", 3, a_curve(1000))
    run(out, "b1", 1, B_CURVE), run(out, "b1", 2, B_CURVE)
    v = judge(study, load_records(out), None)[0]
    assert v.verdict == "inconclusive (needs 2 seeds)" and list(v.speedup["seeds"]) == [1]


def test_not_run_and_no_score(tmp_path):
    assert judged(tmp_path / "1", [a_curve(1000)] * 2, [None, None]).verdict == "not run"
    study = load_study(str(write_study_file(tmp_path / "2", [CLAIM], extra=PLATEAU)))
    out = tmp_path / "2" / "out"
    run(out, "a", 1, a_curve(1000)), run(out, "b1", 1, B_CURVE, status="diverged")
    assert judge(study, load_records(out), None)[0].verdict == "no score"
    run(out, "a", 2, []), run(out, "b1", 2, B_CURVE)  # completed without a valid/loss curve
    v = judge(study, load_records(out), None)[0]
    assert v.verdict == "no score" and "no valid_loss curve in metrics.csv: seed 2 left out" in v.note


def test_margin_and_metric_are_part_of_the_fixed_definition(tmp_path):
    c = load_study(str(write_study_file(tmp_path / "1", [CLAIM]))).claims[0]
    assert definition(c) == {"kind": "fewer_steps", "margin": 1.5, "better": "a", "than": "b1", "metric": "valid_loss",
                             "than_metric": None, "direction": None}
    assert c.interval == "t"
    other = load_study(str(write_study_file(tmp_path / "2", [{**CLAIM, "margin": 2}]))).claims[0]
    assert definition_hash(other) != definition_hash(c)


@pytest.mark.parametrize("change, key, words", [
    ({"margin": None}, "claims[0].margin", "missing: a fewer_steps claim states its speed-up factor"),
    ({"margin": 1.0}, "claims[0].margin", "1.0: a fewer_steps claim needs a speed-up factor > 1"),
    ({"margin": 0.5}, "claims[0].margin", "speed-up factor > 1"),
    ({"margin": True}, "claims[0].margin", "speed-up factor > 1"),
    ({"margin": "1.5"}, "claims[0].margin", "speed-up factor > 1"),
    ({"metric": "test_bleu"}, "claims[0].metric", "reads a validation curve (allowed: valid_loss, valid_nll, valid_ppl)"),
    ({"than_metric": "valid_nll"}, "claims[0].than_metric", "not for a fewer_steps claim"),
    ({"direction": "higher"}, "claims[0].direction", "not for a fewer_steps claim"),
    ({"interval": "bootstrap"}, "claims[0].interval", "the seeds' t interval (allowed: t)"),
    ({"than": None}, "claims[0]", "None is not an arm or best_of group"),
    ({"than": "zz"}, "claims[0]", "'zz' is not an arm or best_of group"),
    ({"cap": 9.0}, "claims[0].cap", "only an lr_sensitivity claim has a cap"),
])
def test_a_bad_fewer_steps_claim_is_one_line_naming_its_key(tmp_path, change, key, words):
    c = {k: v for k, v in {**CLAIM, **change}.items() if v is not None}
    with pytest.raises(UserError) as e:
        load_study(str(write_study_file(tmp_path, [c])))
    assert f": {key}: " in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


def test_the_stability_study_judges_ngpt_on_steps_to_pre_ln_loss():
    c = next(c for c in load_study("stability").claims if c.id == "ngpt_fewer_steps")
    assert (c.kind, c.better, c.than, c.metric, c.margin, c.interval) == ("fewer_steps", "ngpt", "pre_ln", "valid_loss",
                                                                          1.5, "t")
    assert c.carried_from == "language models" and "factor of 4 to 20" in c.paper


def test_a_study_readme_and_the_index_carry_the_claim(tmp_path):
    """The README a study writes (claims.json, the claims table, the lock) and the index row built from it."""
    from normlab.study.index import update_index
    from normlab.study.readme import write_study

    study = load_study(str(write_study_file(tmp_path, [CLAIM], extra=PLATEAU)))
    out = tmp_path / "experiments" / "s"
    for seed, steps in ((1, 1250), (2, 1000), (3, 1000)):
        run(out, "a", seed, a_curve(steps)), run(out, "b1", seed, B_CURVE)
    by_arm = load_records(out)
    readme = write_study(study, by_arm, judge(study, by_arm, None), out, "normlab-study s").read_text()
    assert "| speed-up ×2.32 [1.69, 3.20] (s1 ×2.00, s2 ×2.50, s3 ×2.50) | — | **held** |" in readme
    lock = json.loads((out / "claims.lock.json").read_text())["fast"]
    assert lock["fixed"]["margin"] == 1.5 and lock["verdict"] == "held"
    index = tmp_path / "experiments" / "README.md"
    update_index(index)
    assert "| speed-up ×2.32 [1.69, 3.20] (s1 ×2.00, s2 ×2.50, s3 ×2.50) | t on log speed-ups, 3 seeds, df 2.0; " \
           "margin ×1.5 | **held** |" in index.read_text()
