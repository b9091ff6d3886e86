"""How many seeds a study runs and what they cost: the seed-level interval's verdicts (a family's
pooled variance, an arm whose seeds diverge kept out of it, "inconclusive (needs N seeds)"), arms'
extra_seeds, and each run's share of the machine in the machine-hours."""
import math

import pytest

from normlab.errors import UserError
from normlab.study.claims import judge
from normlab.study.readme import write_study
from normlab.study.records import load_records
from normlab.study.plan import plan
from normlab.study.spec import load_study

from study_files import claim, pairs, record, verdicts, write_study_file


def test_a_claim_that_needs_more_seeds_says_how_many(tmp_path):
    """a: 21, 23 against b1: 20, 20.4 (each arm alone): +1.8 with an interval over zero at 2 seeds;
    at the same variances 5 paired seeds exclude zero (test_study_stats works the half widths by
    hand): "inconclusive (needs 5 seeds)", never held. 1 seed: no variance, plainly inconclusive."""
    v = verdicts(tmp_path, [claim()], pairs([21.0, 23.0], [20.0, 20.4]))["c"]
    assert v.interval.low < 0 < v.interval.high and v.interval.diff == pytest.approx(1.8)
    assert v.verdict == "inconclusive (needs 5 seeds)" and v.needs == 5
    assert v.as_dict()["needs_seeds"] == 5 and v.as_dict()["difference"]["df"] == pytest.approx(v.interval.df)
    v = verdicts(tmp_path / "far", [claim()], pairs([21.0, 23.0], [20.9, 21.3]))["c"]  # +0.9: > 10 seeds
    assert v.verdict == "inconclusive" and v.needs is None
    v = verdicts(tmp_path / "1", [claim()], pairs([27.0], [24.0]))["c"]
    assert v.verdict == "inconclusive" and v.interval.low is None and "not measured" in v.interval.method
    v = verdicts(tmp_path / "3", [claim()], pairs([27.0, 27.2, 26.9], [24.0, 24.1, 24.3]))["c"]
    assert v.verdict == "held" and "sd" not in v.note


def test_needs_seeds_measures_from_the_claims_boundary(tmp_path):
    """valid_nll (lower is better), A no worse than B by 1: A − B = 0.85, 0.95 (s² 0.005, df 1)
    against 2.0, 2.0 lies 0.1 from the boundary +1; the seeds that clear it, by hand with scipy's t:
    t(N − 1) · sqrt(0.005 / N) < 0.1 first at N = 5 (measured from zero it would be 3)."""
    stats = pytest.importorskip("scipy.stats")
    rows = [("a", s, {"valid_nll": x}) for s, x in ((1, 2.85), (2, 2.95))]
    rows += [("b1", s, {"valid_nll": 2.0}) for s in (1, 2)]
    v = verdicts(tmp_path, [claim(kind="no_worse", margin=1.0, metric="valid_nll")], rows)["c"]
    first = next(n for n in range(3, 11) if stats.t.ppf(0.975, n - 1) * math.sqrt(0.005 / n) < 0.1)
    assert first == 5 and v.verdict == "inconclusive (needs 5 seeds)"


def test_a_family_pools_the_seed_variance_of_its_arms(tmp_path):
    """a (27.0, 27.4, 26.8) and b2 (20.0, 20.6) in family F, b1 (24.0, 24.5, 23.9) alone: a's side
    uses s²_F = 11/90 on 3 df (test_study_stats works the interval by hand), b1 its own."""
    stats = pytest.importorskip("scipy.stats")
    rows = pairs([27.0, 27.4, 26.8], [24.0, 24.5, 23.9]) + [("b2", s, {"test_bleu": x, "valid_bleu": 1.0})
                                                            for s, x in ((1, 20.0), (2, 20.6))]
    v = verdicts(tmp_path, [claim()], rows, families={"a": "F", "b2": "F"})["c"]
    va, vb = v.variance["a"], v.variance["b1"]
    assert (va.s2, va.df, va.source, va.arms) == (pytest.approx(11 / 90), 3, "family:F", ("a", "b2"))
    assert (vb.s2, vb.df, vb.source) == (pytest.approx(31 / 300), 2, "arm:b1")
    se2 = 11 / 90 / 3 + 31 / 300 / 3
    df = se2 ** 2 / ((11 / 90 / 3) ** 2 / 3 + (31 / 300 / 3) ** 2 / 2)
    half = stats.t.ppf(0.975, df) * math.sqrt(se2)
    assert (v.interval.low, v.interval.high) == pytest.approx((81.2 / 3 - 72.4 / 3 - half, 81.2 / 3 - 72.4 / 3 + half))
    assert v.verdict == "held" and "a pooled over family F (a, b2: s² 0.122, df 3)" in v.note
    assert v.as_dict()["variance"]["a"]["source"] == "family:F"


def test_an_arm_whose_seeds_diverge_is_not_pooled(tmp_path):
    """Family F = a, b2, b3. a's seeds 20, 28, 24 (s² 16) against the rest's pooled 0.0325 on 2 df:
    F = 492 > F_0.95(2, 2) = 19, so a uses its own variance and stays out of b2's pool; with a's
    seeds at 23.0, 23.4, 23.2 (s² 0.04: F 1.2) all three pool. An arm with a stalled seed beside
    completed ones uses its own variance too."""
    arms = {"a": ["x=1"], "b1": ["x=2"], "b2": ["x=3"], "b3": ["x=4"]}
    fam = {"a": "F", "b2": "F", "b3": "F"}
    cl = [claim(id="a"), claim(id="b2", better="b2")]
    rest = [("b2", s, {"test_bleu": x}) for s, x in ((1, 22.0), (2, 22.2))]
    rest += [("b3", s, {"test_bleu": x}) for s, x in ((1, 23.0), (2, 23.3))]
    rest += [("b1", s, {"test_bleu": 10.0 + s / 10}) for s in (1, 2, 3)]
    wide = [("a", s, {"test_bleu": x}) for s, x in ((1, 20.0), (2, 28.0), (3, 24.0))]
    v = verdicts(tmp_path, cl, wide + rest, arms=arms, families=fam)
    a, b2 = v["a"].variance["a"], v["b2"].variance["b2"]
    assert (a.s2, a.df, a.source) == (pytest.approx(16.0), 2, "arm:a") and "F_0.95(2, 2) = 19.0" in a.why
    assert (b2.s2, b2.df, b2.arms) == (pytest.approx(0.0325), 2, ("b2", "b3"))
    assert "a its own (s² 16, df 2: its seed variance 16 is 492.3x the rest of F's 0.0325" in v["a"].note
    near = [("a", s, {"test_bleu": x}) for s, x in ((1, 23.0), (2, 23.4), (3, 23.2))]
    v = verdicts(tmp_path / "near", cl, near + rest, arms=arms, families=fam)
    assert v["a"].variance["a"].arms == ("a", "b2", "b3") and v["b2"].variance["b2"].df == 4
    stalled = near + rest + [("b3", 3, {"status": "stalled"})]
    v = verdicts(tmp_path / "stalled", [claim(id="b3", better="b3"), *cl], stalled, arms=arms, families=fam)
    b3 = v["b3"].variance["b3"]
    assert b3.source == "arm:b3" and b3.why == "1 seed diverged or stalled beside 2 that completed"
    assert v["a"].variance["a"].arms == ("a", "b2")


def test_extra_seeds_run_for_their_arms_only(tmp_path):
    """An arm's extra_seeds (a third seed where a claim's two left the rule unmet) add its runs at the
    full budget only; the README's cost line names them; a bad value is one error naming the key."""
    path = write_study_file(tmp_path, [claim()], arms={"a": ["norm=prenorm"], "b1": ["norm=postnorm"],
                                                      "b2": ["norm=postnorm", "optim.lr=1e-3"]})
    text = path.read_text().replace("seeds: [1, 2, 3]", "seeds: [1, 2]")
    path.write_text(text.replace("  b2: {overrides: [norm=postnorm, optim.lr=1e-3]}",
                                 "  b2: {overrides: [norm=postnorm, optim.lr=1e-3], extra_seeds: [3]}")
                    .replace("  b1: {overrides: [norm=postnorm]}", "  b1: {overrides: [norm=postnorm], extra_seeds: [3]}"))
    study = load_study(str(path))
    jobs = plan(study, tmp_path / "runs", tmp_path / "out")
    assert [j.tag for j in jobs] == ["a seed 1", "b1 seed 1", "b2 seed 1", "a seed 2", "b1 seed 2", "b2 seed 2",
                                     "b1 seed 3", "b2 seed 3"]
    assert study.planned == 8 and study.all_seeds == (1, 2, 3)
    assert len(plan(load_study(str(path), "smoke"), tmp_path / "runs", tmp_path / "out")) == 6
    out = tmp_path / "out"
    for j in jobs[:6]:
        record(out, j.arm.name, j.seed, test_bleu=20.0 + j.seed, valid_bleu=20.0, steps=10, wall_s=1.0)
    by_arm = load_records(out)
    write_study(study, by_arm, judge(study, by_arm, None), out, "normlab-study s")
    cost_line = (out / "README.md").read_text().split("## Cost", 1)[1].split("##", 1)[0]
    assert "seeds 1, 2 of 1, 2, 3 planned; seed 3 of b1, b2 only); 6 of 8 planned runs recorded" in cost_line
    path.write_text(text.replace("  a: {overrides: [norm=prenorm]}", "  a: {overrides: [norm=prenorm], extra_seeds: 3}"))
    with pytest.raises(UserError, match=r"arms.a.extra_seeds: must be a list of integer seeds"):
        load_study(str(path))


def test_machine_share_is_threads_of_cores_where_the_record_names_them(tmp_path):
    """A run's machine-hours: 1 / --jobs, at most threads / cores where a CPU record names them (a
    1-thread run of a --jobs 1 study beside another study used half the machine, as a job of a
    2-job sweep does; 3 one-thread jobs on 2 cores a third each); without a device, or on a GPU, 1 / --jobs."""
    from normlab.study.readme import cost, machine_share

    assert machine_share({"device": "cpu: x86_64, 2 cores, 1 thread", "study": {"jobs": 1}}) == 0.5
    assert machine_share({"device": "cpu: x86_64, 2 cores, 1 threads", "study": {"jobs": 1}}) == 0.5  # before d292872
    assert machine_share({"device": "cpu: x86_64, 2 cores, 2 threads", "study": {"jobs": 1}}) == 1.0
    assert machine_share({"device": "cpu: x86_64, 2 cores, 4 threads"}) == 1.0
    assert machine_share({"device": "cpu: x86_64, 2 cores, 1 thread", "study": {"jobs": 3}}) == pytest.approx(1 / 3)
    assert machine_share({"device": "cuda: NVIDIA A100 x 4", "study": {"jobs": 2}}) == 0.5
    assert machine_share({"study": {"jobs": 3}}) == pytest.approx(1 / 3) and machine_share({}) == 1.0
    out = tmp_path / "out"
    record(out, "a", 1, wall_s=3600.0, steps=10, device="cpu: x86_64, 2 cores, 1 thread")
    record(out, "b1", 1, wall_s=3600.0, steps=10, study={"arm": "b1", "seed": 1, "jobs": 2})
    assert cost(load_records(out))["machine_hours"] == pytest.approx(1.0)


def test_extra_seeds_are_refused_where_they_would_mislead(tmp_path):
    """A best_of group whose candidates run different seeds (the pick compares their means) and a
    probe study (every arm runs the study's seeds) refuse extra_seeds, naming the key."""
    path = write_study_file(tmp_path, [claim(than="b_best")])
    path.write_text(path.read_text().replace("  b1: {overrides: [norm=postnorm, optim.lr=1e-3]}",
                                             "  b1: {overrides: [norm=postnorm, optim.lr=1e-3], extra_seeds: [4]}"))
    with pytest.raises(UserError, match=r"best_of.b_best.arms: its arms must have the same extra_seeds"):
        load_study(str(path))
    both = path.read_text().replace("  b2: {overrides: [norm=postnorm]}", "  b2: {overrides: [norm=postnorm], extra_seeds: [3, 4]}")
    path.write_text(both.replace("extra_seeds: [4]}", "extra_seeds: [4, 3, 3]}"))  # the same seeds beyond the study's
    assert load_study(str(path)).seeds_of(load_study(str(path)).arms["b1"]) == (1, 2, 3, 4)
    probe = tmp_path / "p.yaml"
    probe.write_text("title: t\npaper: p\nquestion: q\nkind: probe\nprobe: {depths: [2, 4]}\nseeds: [1]\n"
                     "arms:\n  a: {model: {norm: {placement: pre}}, extra_seeds: [2]}\n")
    with pytest.raises(UserError, match=r"arms.<arm>.extra_seeds: not for a probe study"):
        load_study(str(probe))


def test_a_claim_whose_arms_ran_different_seeds_pairs_the_common_ones(tmp_path):
    """A ran seeds 1-3 (an extra seed), B 1-2: the claim's means and interval are over seeds 1 and 2,
    and its note says so."""
    rows = pairs([27.0, 27.2, 30.0], [24.0, 24.1])
    v = verdicts(tmp_path, [claim()], rows)["c"]
    assert v.interval.n == 2 and v.means == {"a": pytest.approx(27.1), "b1": pytest.approx(24.05)}
    assert "paired on seeds 1, 2" in v.note
