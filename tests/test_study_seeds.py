"""How many seeds a study runs and what they cost: issue 17's seeds rule (3 seeds, or 2 with a
difference > 3 sd of the seeds' differences from the claim's decision boundary), arms' extra_seeds,
and each run's share of the machine in the machine-hours."""
import pytest

from normlab.errors import UserError
from normlab.study.claims import judge
from normlab.study.readme import write_study
from normlab.study.records import load_records
from normlab.study.runner import plan
from normlab.study.spec import load_study

from study_files import claim, pairs, record, verdicts, write_study_file


def test_fewer_than_3_seeds_say_whether_the_rule_is_met(tmp_path):
    """Issue 17's rule: 3 seeds, or 2 when the difference exceeds 3 sd of the seeds' differences.
    2 seeds with differences 3.0 and 3.2 (mean 3.1, sd 0.141: 21.9 sd) meet it; 3.0 and 1.0
    (mean 2.0, sd 1.414: 1.4 sd) do not; 1 seed never does; 3 seeds are not marked."""
    v = verdicts(tmp_path, [claim()], pairs([27.0, 27.2], [24.0, 24.0]))["c"]
    assert v.seeds_rule["enough"] and v.seeds_rule["effect_sd"] == pytest.approx(3.1 / (0.2 / 2 ** 0.5), abs=0.01)
    assert "2 paired seeds: the difference is 21.9 sd" in v.note and "enough by the rule" in v.note
    v = verdicts(tmp_path / "2", [claim()], pairs([27.0, 25.0], [24.0, 24.0]))["c"]
    assert not v.seeds_rule["enough"] and v.seeds_rule["effect_sd"] == pytest.approx(2.0 / 2 ** 0.5, abs=0.01)
    assert "a third seed is needed" in v.note
    v = verdicts(tmp_path / "1", [claim()], pairs([27.0], [24.0]))["c"]
    assert not v.seeds_rule["enough"] and v.seeds_rule["effect_sd"] is None and "not measured" in v.note
    v = verdicts(tmp_path / "3", [claim()], pairs([27.0, 27.2, 26.9], [24.0, 24.1, 24.3]))["c"]
    assert v.seeds_rule is None and v.note == ""
    from normlab.study.readme import seeds_mark

    assert seeds_mark({"seeds": 2, "effect_sd": 1.41, "enough": False}) == ", 1.4 sd: a 3rd seed needed"
    assert seeds_mark({"seeds": 2, "effect_sd": 21.9, "enough": True}) == ", 21.9 sd" and seeds_mark(None) == ""
    assert seeds_mark({"seeds": 1, "effect_sd": None, "enough": False}) == ": more seeds needed"


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


@pytest.mark.parametrize("kind, diffs, enough", [
    # similar (margin 1): 0.9 and 0.95 sit next to the margin (0.075 from it, sd 0.035: 2.1 sd)
    ("similar", [0.9, 0.95], False),
    # similar: 0.0 and 0.1 lie well inside it (0.95 from it, sd 0.071: 13.4 sd)
    ("similar", [0.0, 0.1], True),
    # no_worse (margin 1): -0.2 and -0.1 are 0.85 above -1 (sd 0.071: 12.0 sd)
    ("no_worse", [-0.2, -0.1], True),
    ("no_worse", [-1.2, -0.6], False),  # 0.1 from -1, sd 0.42: 0.2 sd
])
def test_the_rule_measures_the_distance_from_the_claims_boundary(tmp_path, kind, diffs, enough):
    """For "about as good as" claims a large difference is not evidence for them: the rule measures
    the mean difference's distance from the margin, not from zero."""
    import numpy as np

    v = verdicts(tmp_path, [claim(kind=kind, margin=1.0)], pairs([20.0 + d for d in diffs], [20.0, 20.0]))["c"]
    mean, sd = float(np.mean(diffs)), float(np.std(diffs, ddof=1))
    distance = abs(abs(mean) - 1.0) if kind == "similar" else abs(mean + 1.0)
    assert v.seeds_rule["enough"] is enough
    assert v.seeds_rule["effect_sd"] == pytest.approx(distance / sd, abs=0.01)
    assert "distance from the margin 1" in v.note


def test_the_rule_for_a_lower_is_better_no_worse_claim(tmp_path):
    """valid_nll (lower is better), A no worse than B by 1: A − B of 0.85 and 0.95 lies 0.1 from the
    boundary +1 (sd 0.071: 1.4 sd), not enough; the index cell says it is measured from the margin."""
    from normlab.study.readme import seeds_mark

    rows = [("a", s, {"valid_nll": x}) for s, x in ((1, 2.85), (2, 2.95))]
    rows += [("b1", s, {"valid_nll": 2.0}) for s in (1, 2)]
    v = verdicts(tmp_path, [claim(kind="no_worse", margin=1.0, metric="valid_nll")], rows)["c"]
    assert v.seeds_rule["effect_sd"] == pytest.approx(0.1 / (0.1 / 2 ** 0.5), abs=0.01) and not v.seeds_rule["enough"]
    assert seeds_mark(v.seeds_rule) == ", 1.4 sd from the margin: a 3rd seed needed"


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
