"""Claims are judged from records: every verdict, best_of chosen on validation, similar / fails /
trains / no_worse, pruned-model metrics, the bootstrap over translations, and the cost of the runs
(test_study.py checks the study files and runs the command)."""
import json

import pytest

from normlab.study.claims import judge
from normlab.study.records import load_records
from normlab.study.spec import load_study
from study_files import claim, pairs, record, verdicts, write_study_file


def test_verdicts_follow_the_interval(tmp_path):
    v = verdicts(tmp_path, [claim()], pairs([27.0, 27.2, 26.9], [24.0, 24.1, 24.3]))["c"]
    assert v.verdict == "held" and v.interval.low > 0 and v.interval.method.startswith("t over 3 paired seeds, df ")
    v = verdicts(tmp_path / "2", [claim()], pairs([24.0, 24.1, 24.3], [27.0, 27.2, 26.9]))["c"]
    assert v.verdict == "contradicted" and v.interval.high < 0
    v = verdicts(tmp_path / "3", [claim()], pairs([27.0, 24.0, 26.0], [26.0, 25.0, 25.5]))["c"]
    assert v.verdict == "inconclusive" and v.interval.low < 0 < v.interval.high


def test_lower_is_better_for_loss_metrics(tmp_path):
    rows = [("a", s, {"valid_nll": x}) for s, x in ((1, 2.0), (2, 2.1), (3, 2.05))]
    rows += [("b1", s, {"valid_nll": x}) for s, x in ((1, 2.5), (2, 2.6), (3, 2.55))]
    assert verdicts(tmp_path, [claim(metric="valid_nll")], rows)["c"].verdict == "held"


def test_no_score_when_an_arm_did_not_train(tmp_path):
    study = load_study(str(write_study_file(tmp_path, [claim()])))
    out = tmp_path / "out"
    for arm, seed in (("a", 1), ("a", 2)):
        record(out, arm, seed, test_bleu=20.0)
    for seed in (1, 2):
        record(out, "b1", seed, status="stalled", test_bleu=0.5)
    v = judge(study, load_records(out), None)[0]
    assert v.verdict == "no score" and v.statuses["b1"] == {"stalled": 2} and v.interval is None


def test_not_run_when_an_arm_has_no_record_or_no_seed_in_common(tmp_path):
    study = load_study(str(write_study_file(tmp_path, [claim()])))
    out = tmp_path / "out"
    record(out, "a", 1, test_bleu=20.0)
    v = judge(study, load_records(out), None)[0]
    assert v.verdict == "not run" and v.statuses["b1"] == {}
    record(out, "b1", 1, status="stalled", test_bleu=0.5)  # ran, and stalled: no score
    assert judge(study, load_records(out), None)[0].verdict == "no score"
    out2 = tmp_path / "out2"  # both trained, on different seeds: nothing to pair yet
    record(out2, "a", 1, test_bleu=20.0)
    record(out2, "b1", 2, test_bleu=19.0)
    assert judge(study, load_records(out2), None)[0].verdict == "not run"
    out3 = tmp_path / "out3"  # a completed run without the claim's metric did train: not "no score"
    record(out3, "a", 1, test_bleu=20.0)
    record(out3, "b1", 1, valid_bleu=19.0)
    assert judge(study, load_records(out3), None)[0].verdict == "not run"


def test_no_score_sees_every_candidate_of_a_best_of_side(tmp_path):
    """The side b_best ran when any of its candidates did: b1 (the one the pick falls back to) has
    no record, b2 stalled."""
    study = load_study(str(write_study_file(tmp_path, [claim(than="b_best")])))
    out = tmp_path / "out"
    record(out, "a", 1, test_bleu=20.0)
    record(out, "b2", 1, status="stalled", test_bleu=0.1)
    v = judge(study, load_records(out), None)[0]
    assert v.verdict == "no score" and v.than == "b2" and v.statuses == {"a": {"completed": 1}, "b2": {"stalled": 1}}


def test_best_of_picks_by_validation_not_test(tmp_path):
    # b2 has the better test BLEU but the worse valid BLEU: the claim must use b1
    rows = [("a", s, {"test_bleu": 25.0, "valid_bleu": 20.0}) for s in (1, 2, 3)]
    rows += [("b1", s, {"test_bleu": 24.0 + s * 0.1, "valid_bleu": 19.0}) for s in (1, 2, 3)]
    rows += [("b2", s, {"test_bleu": 26.0 + s * 0.1, "valid_bleu": 18.0}) for s in (1, 2, 3)]
    v = verdicts(tmp_path, [claim(than="b_best")], rows)["c"]
    assert v.than == "b1" and "best of b1, b2 by mean valid_bleu" in v.note and v.verdict == "held"


def test_the_cost_names_the_devices_the_runs_trained_on(tmp_path):
    from normlab.study.readme import cost

    out = tmp_path / "out"
    record(out, "a", 1, wall_s=3600.0, device="cpu: x86_64, 2 cores, 1 thread", study={"jobs": 2})
    record(out, "a", 2, wall_s=1800.0, device="cuda: NVIDIA A100 x 2")
    record(out, "b1", 1, wall_s=360.0)  # a record from before results.json named the device
    record(out, "b1", 2, wall_s=0.0, device="cpu: x86_64, 2 cores, 1 threads")  # before d292872: the same device
    c = cost(load_records(out))
    assert c["devices"] == ["cpu: x86_64, 2 cores, 1 thread", "cuda: NVIDIA A100 x 2", "device not recorded"]
    assert abs(c["machine_hours"] - (0.5 + 0.5 + 0.1)) < 1e-9  # the 2-job run counts half its wall time
    assert c["code"] == "not recorded for 4 runs (trained before 80501ee)"
    record(out, "b2", 1, code={"commit": "1c0cccd56ee3b52f2cd7b42b371886cafe0eac95", "dirty": False})
    record(out, "b2", 2, code={"commit": "1c0cccd56ee3b52f2cd7b42b371886cafe0eac95", "dirty": True})
    record(out, "b2", 3, code={"commit": "1c0cccd56ee3b52f2cd7b42b371886cafe0eac95", "dirty": False})
    assert cost(load_records(out))["code"] == ("1c0cccd at its last leg (2 runs), 1c0cccd+changes at its last leg "
                                               "(1 run); not recorded for 4 runs (trained before 80501ee)")
    record(out, "b2", 4, code={"commit": None, "dirty": None})  # not a git checkout, or no git to ask
    assert cost(load_records(out))["code"].startswith("1c0cccd at its last leg (2 runs), 1c0cccd+changes at its "
                                                      "last leg (1 run), commit unknown at its last leg (1 run); ")
    # code_legs: the commits of every leg, in order (consecutive legs on one commit named once); a
    # leg from a checkpoint written before code_legs existed has no commit
    a, b = "1c0cccd56ee3b52f2cd7b42b371886cafe0eac95", "26f455f0000000000000000000000000000000000"
    record(out, "b1", 3, code={"commit": b, "dirty": False}, code_legs=[
        {"from_step": 0, "commit": a, "dirty": False}, {"from_step": 400, "commit": a, "dirty": False},
        {"from_step": 800, "commit": b, "dirty": False}])
    record(out, "b1", 4, code={"commit": b, "dirty": False}, code_legs=[
        {"from_step": 0, "commit": None, "dirty": None}, {"from_step": 1400, "commit": b, "dirty": False}])
    assert cost(load_records(out))["code"] == (
        "1c0cccd at its last leg (2 runs), 1c0cccd → 26f455f (1 run), 1c0cccd+changes at its last leg (1 run), "
        "commit unknown at its last leg (1 run), commit unknown → 26f455f (1 run); not recorded for 4 runs "
        "(trained before 80501ee)")


def test_best_of_puts_a_candidate_that_stalled_on_a_seed_last(tmp_path):
    # b1 has the better valid BLEU on the seeds that trained, but stalled on seed 3 (no valid BLEU:
    # final_test.py): a mean over its trained seeds alone would pick it; b2 trained on every seed
    rows = [("a", s, {"test_bleu": 25.0, "valid_bleu": 20.0}) for s in (1, 2, 3)]
    rows += [("b1", s, {"test_bleu": 24.0 + s * 0.1, "valid_bleu": 19.0}) for s in (1, 2)]
    rows += [("b1", 3, {"status": "stalled", "valid_bleu": None, "test_bleu": None})]
    rows += [("b2", s, {"test_bleu": 22.0 + s * 0.1, "valid_bleu": 18.0}) for s in (1, 2, 3)]
    v = verdicts(tmp_path, [claim(than="b_best")], rows)["c"]
    assert v.than == "b2" and v.verdict == "held"
    # without the stalled seed, b1 is the pick (the rule only demotes a candidate that failed)
    v = verdicts(tmp_path / "2", [claim(than="b_best")], [r for r in rows if r[2].get("status") != "stalled"])["c"]
    assert v.than == "b1"


def test_similar_fails_trains_and_other_metric(tmp_path):
    rows = [("a", s, {"test_bleu": 25.0 + 0.1 * s, "other": 25.05 + 0.1 * s}) for s in (1, 2, 3)]
    rows += [("b1", s, {"test_bleu": 10.0}) for s in (1, 2, 3)]
    cl = [claim(id="sim", kind="similar", than="a", than_metric="other", margin=0.5),
          claim(id="far", kind="similar", than="b1", margin=1.0),
          claim(id="fails", kind="fails", than=None), claim(id="trains", kind="trains", than=None)]
    got = verdicts(tmp_path, cl, rows)
    assert got["sim"].verdict == "held" and got["sim"].interval.diff == pytest.approx(-0.05)
    assert got["far"].verdict == "contradicted"
    assert got["fails"].verdict == "contradicted" and got["trains"].verdict == "held"


def test_fails_held_when_every_seed_stalls(tmp_path):
    study = load_study(str(write_study_file(tmp_path, [claim(kind="fails", than=None)])))
    out = tmp_path / "out"
    record(out, "a", 1, status="stalled")
    record(out, "a", 2, status="diverged")
    assert judge(study, load_records(out), None)[0].verdict == "held"
    record(out, "a", 3, test_bleu=20.0)
    assert judge(study, load_records(out), None)[0].verdict == "inconclusive"


def test_prune_metrics_from_records(tmp_path):
    out = tmp_path / "out"
    record(out, "a", 1, test_bleu=20.0)
    (out / "runs" / "a-s1" / "prune.json").write_text(json.dumps({"rows": [
        {"strategy": "full", "kept": 6, "test_bleu": 20.0},
        {"strategy": "every_other", "kept": 3, "test_bleu": 12.5},
        {"strategy": "data_driven", "kept": 3, "test_bleu": None, "note": "n/a"}]}))
    rec = load_records(out)["a"][0]
    assert rec.metric("prune.every_other.r3.test_bleu") == 12.5
    assert rec.metric("prune.data_driven.r3.test_bleu") is None
    assert rec.metric("prune.search_on_valid.r3.test_bleu") is None


def test_end_value_of_a_logged_series(tmp_path):
    """end.train_nll: the mean over the last tenth of the steps (here steps 90-100 of 100), from metrics.csv."""
    out = tmp_path / "out"
    record(out, "a", 1, test_bleu=20.0)
    rows = ["epoch,step,train/nll,valid/nll"] + [f"0,{s},{s / 10},," for s in range(0, 101, 5)] + ["0,100,,7.0"]
    (out / "runs" / "a-s1" / "metrics.csv").write_text("\n".join(rows) + "\n")
    rec = load_records(out)["a"][0]
    assert rec.metric("end.train_nll") == pytest.approx((9.0 + 9.5 + 10.0) / 3)
    assert rec.metric("end.valid_nll") == 7.0
    assert rec.metric("end.test_bleu") is None  # not a logged series


def test_bootstrap_over_pruned_models_translations(tmp_path):
    """A claim on pruned models' test BLEU gets its test-set check (the bootstrap) and its sentence
    variance from the translations the record keeps (prune.<strategy>.r<kept>.test.hyp.gz); a record
    without them is judged on the seeds alone, and says so."""
    import gzip

    from normlab.study.stats import corpus_bleu, sentence_stats

    refs = [f"the cat number {i} sat on the mat today" for i in range(60)]
    good = [r if i % 3 else "the cat sat" for i, r in enumerate(refs)]
    bad = [r if i % 2 else "a dog" for i, r in enumerate(refs)]

    def bleu(hyps):
        return round(float(corpus_bleu(sentence_stats(hyps, refs).sum(0))), 4)

    out = tmp_path / "out"
    for seed in (1, 2):
        record(out, "a", seed, test_bleu=bleu(bad))
        (out / "runs" / f"a-s{seed}" / "prune.json").write_text(json.dumps({"rows": [
            {"strategy": "every_other", "kept": 1, "test_bleu": bleu(good)}]}))
        with gzip.open(out / "runs" / f"a-s{seed}" / "prune.every_other.r1.test.hyp.gz", "wt") as f:
            f.write("".join(h + "\n" for h in good))
        with gzip.open(out / "runs" / f"a-s{seed}" / "test.hyp.gz", "wt") as f:
            f.write("".join(h + "\n" for h in bad))
    c = claim(better="a", than="a", metric="prune.every_other.r1.test_bleu", than_metric="test_bleu",
              interval="bootstrap")
    study = load_study(str(write_study_file(tmp_path, [c])))
    (v,) = judge(study, load_records(out), refs)
    assert v.check.method.startswith("bootstrap") and v.verdict == "held", v.check
    assert v.interval.method.endswith("+ test sentences") and v.interval.se == pytest.approx(v.check.se)
    assert v.interval.diff == pytest.approx(bleu(good) - bleu(bad), abs=0.01)
    assert v.check.diff == pytest.approx(bleu(good) - bleu(bad), abs=0.01)
    for seed in (1, 2):
        (out / "runs" / f"a-s{seed}" / "prune.every_other.r1.test.hyp.gz").unlink()
    (v,) = judge(study, load_records(out), refs)
    assert v.check is None and v.interval.method.startswith("t over") and "no test-set check" in v.note


def test_cost_counts_shared_machine_time_once_and_says_which_seeds_ran(tmp_path):
    from normlab.study.readme import cost

    out = tmp_path / "out"
    record(out, "a", 1, wall_s=3600.0, steps=2000)  # alone (a record from before --jobs: 1)
    for seed in (1, 2):
        record(out, "b1", seed, wall_s=3600.0, steps=2000, study={"arm": "b1", "seed": seed, "jobs": 2})
    c = cost(load_records(out))
    assert c["runs"] == 3 and c["machine_hours"] == pytest.approx(1 + 0.5 + 0.5) and c["seeds"] == [1, 2]


@pytest.mark.parametrize("low, high, verdict", [(-0.5, 3.0, "held"), (0.5, 4.0, "held"), (-1.5, 0.2, "inconclusive"),
                                                (-3.0, -1.2, "contradicted"), (-1.0, 2.0, "inconclusive")])
def test_no_worse_is_one_sided_non_inferiority(low, high, verdict):
    """kind: no_worse (LayerDrop "matches or improves"): held when the whole interval is above
    −margin, a large gain included; contradicted when it is wholly at or below −margin."""
    from normlab.study.claims import verdict_of
    from normlab.study.spec import Claim
    from normlab.study.stats import Interval

    c = Claim(id="c", claim="x", source="s", paper="p", better="a", than="b", kind="no_worse", margin=1.0)
    assert verdict_of(Interval((low + high) / 2, low, high, "t", 2), c, lower_better=False) == verdict
    # for a loss (lower is better) the same interval of B's side: mirrored
    assert verdict_of(Interval(-(low + high) / 2, -high, -low, "t", 2), c, lower_better=True) == verdict


def test_the_cost_names_the_cpus_and_kernel_paths(tmp_path):
    # issue 34: fp32 rounds by kernel path; a record before results.json named its CPU says so
    from normlab.study.readme import cost

    out = tmp_path / "out"
    epyc = {"model": "AMD EPYC", "isa": "avx2", "capability": "AVX2", "mkl": "2024.2, auto", "onednn": "3.12.0, auto"}
    record(out, "a", 1, cpu=epyc)
    record(out, "a", 2, cpu=epyc)
    record(out, "b", 1, cpu={**epyc, "capability": "DEFAULT", "mkl": "2024.2, MKL_CBWR=COMPATIBLE"})
    record(out, "b", 2)
    assert cost(load_records(out))["cpus"] == (
        "AMD EPYC, AVX2 kernels (2 runs); AMD EPYC, DEFAULT kernels (MKL_CBWR=COMPATIBLE) (1 run); "
        "not recorded (1 run, trained before results.json named its CPU)")


def test_the_cost_charges_the_cpu_time_each_run_used(tmp_path):
    # issue 36: CPU seconds as recorded; a record from before they were: wall x share x cores
    from normlab.study.readme import cost, run_cpu_hours

    dev = "cpu: x86_64, AMD EPYC, AVX2 kernels, 2 cores, 1 thread"
    assert run_cpu_hours({"cpu_s": 5400.0, "wall_s": 99999.0, "device": dev}) == (1.5, True)
    assert run_cpu_hours({"wall_s": 3600.0, "device": dev, "study": {"jobs": 2}}) == (0.5 * 2, False)
    assert run_cpu_hours({"wall_s": 3600.0, "device": "cuda: NVIDIA A100"}) == (1.0, False)
    for damaged in (-99999.0, float("inf"), float("nan")):  # not a CPU time: estimated as if not recorded
        assert run_cpu_hours({"cpu_s": damaged, "wall_s": 3600.0, "device": dev}) == (1.0, False)
    out = tmp_path / "out"
    record(out, "a", 1, wall_s=7200.0, cpu_s=3600.0, device=dev, identity_hash="h1")  # beside another job
    record(out, "a", 2, wall_s=3600.0, cpu_s=7200.0, device=dev.replace("1 thread", "2 threads"), identity_hash="h2")
    record(out, "b", 1, wall_s=3600.0, device=dev, study={"jobs": 2}, identity_hash="h3")  # 3600 x 1/2 x 2 cores
    c = cost(load_records(out))
    assert c["cpu_hours"] == pytest.approx(1 + 2 + 1) and c["cpu_estimated"] == 1
    assert sorted(c["cpu_by_run"].values()) == pytest.approx([1.0, 1.0, 2.0])
