"""A claim's metric read from a record (study/records.py): a flat results.json key, a dotted path into
its nested values, and the observatory's per-stack means (obs.<stack>.<statistic>), on synthetic
records; and a compare claim judged on one of them."""
import pytest

from normlab.study.records import Record

from study_files import claim, verdicts

OBS = {"step": 2000, "layers": {
    "enc.0.self_attn": {"kurtosis": 1.0, "sink_h0": 0.1, "sink_h1": 0.3, "max_logit": 5.0},
    "enc.0.ffn": {"kurtosis": 3.0},
    "dec.0.self_attn": {"kurtosis": 2.0, "sink_h0": 0.6, "sink_h1": 0.8},
    "dec.0.cross_attn": {"kurtosis": 4.0, "sink_h0": 0.2, "sink_h1": None},  # a head with no value (nan in the run)
    "dec.0.ffn": {"kurtosis": 6.0, "out_rms": 1.5}}}


def rec(results: dict) -> Record:
    return Record(None, "a", 1, results)


def test_a_dotted_path_reads_nested_values_and_keys_that_hold_dots():
    r = rec({"valid_nll": 3.5, "observatory": OBS, "a.b": 7.0, "nested": {"x": {"y": 2}}, "flag": True})
    assert r.metric("valid_nll") == 3.5 and r.metric("a.b") == 7.0  # a flat key first, dots and all
    assert r.metric("nested.x.y") == 2.0 and r.metric("observatory.step") == 2000.0
    assert r.metric("observatory.layers.dec.0.self_attn.sink_h1") == 0.8  # the block's name holds dots
    for missing in ("nested.x", "nested.x.z", "observatory.layers.dec.9.ffn.kurtosis", "flag", "valid_nll.x"):
        assert r.metric(missing) is None  # not a number there


def test_observatory_means_average_the_heads_then_the_stack_blocks():
    r = rec({"observatory": OBS})
    # enc: self_attn (0.1 + 0.3) / 2 = 0.2; dec: self (0.6 + 0.8) / 2 = 0.7, cross 0.2 (its null head left out)
    assert r.metric("obs.enc.sink") == pytest.approx(0.2)
    assert r.metric("obs.dec.sink") == pytest.approx((0.7 + 0.2) / 2)
    assert r.metric("obs.all.sink") == pytest.approx((0.2 + 0.7 + 0.2) / 3)
    assert r.metric("obs.dec.kurtosis") == pytest.approx(4.0) and r.metric("obs.all.kurtosis") == pytest.approx(3.2)
    assert r.metric("obs.enc.max_logit") == 5.0 and r.metric("obs.enc.out_rms") is None
    assert r.metric("obs.dec.self_attn.sink") == pytest.approx(0.7)  # one kind of sub-layer
    assert r.metric("obs.dec.cross_attn.sink") == pytest.approx(0.2) and r.metric("obs.all.ffn.kurtosis") == \
        pytest.approx(4.5)
    for bad in ("obs.mid.sink", "obs.dec", "obs.dec.sink_h", "obs.dec.mlp.sink", "obs.dec.self_attn.sink.x"):
        assert r.metric(bad) is None
    assert rec({}).metric("obs.dec.sink") is None  # a run without the observatory
    assert r.metric("obs.dec.self_attn.sink_h1") == pytest.approx(0.8)  # one head, by the observatory's name


def test_a_claim_may_name_one_head_and_nothing_else_after_the_statistic():
    from normlab.study.records import observatory_name_problem

    assert observatory_name_problem("obs.dec.self_attn.sink_h0") is None
    assert observatory_name_problem("obs.enc.entropy_h12") is None
    for bad in ("obs.dec.sink_h", "obs.dec.sink_hx", "obs.dec.kurtosis_h0", "obs.dec.sinks"):
        what, allowed = observatory_name_problem(bad)
        assert "is not a statistic of the observatory" in what and "sink_h<i>" in allowed, bad


def test_a_compare_claim_reads_an_observatory_mean(tmp_path):
    def obs(sink):  # one decoder block, one head
        return {"observatory": {"step": 1, "layers": {"dec.0.self_attn": {"sink_h0": sink}}}}

    rows = [("a", s, obs(x)) for s, x in ((1, 0.10), (2, 0.12), (3, 0.11))]
    rows += [("b1", s, obs(x)) for s, x in ((1, 0.60), (2, 0.62), (3, 0.58))]
    v = verdicts(tmp_path, [claim(metric="obs.dec.sink", direction="lower")], rows)["c"]
    assert v.means == {"a": pytest.approx(0.11), "b1": pytest.approx(0.60)}
    assert v.verdict == "held" and v.interval.diff == pytest.approx(-0.49)


@pytest.mark.integration
@pytest.mark.parametrize("key, metric, message", [
    ("metric", "obs.dec.self_atn.sink", "'obs.dec.self_atn.sink': 'self_atn' is not a kind of sub-layer of the "
     "observatory (allowed: self_attn, cross_attn, ffn)"),
    ("metric", "obs.enc.kurtosiss", "'obs.enc.kurtosiss': 'kurtosiss' is not a statistic of the observatory (allowed: "
     "rms, max_abs, kurtosis, out_rms, out_max_abs, entropy, sink, max_logit, grad_norm, grad_spike, entropy_h<i>, "
     "sink_h<i>)"),
    ("metric", "obs.mid.sink", "'obs.mid.sink': 'mid' is not a stack of the observatory (allowed: enc, dec, all)"),
    ("than_metric", "obs.dec", "'obs.dec': not obs.<enc|dec|all>[.<self_attn|cross_attn|ffn>].<statistic> (allowed: "),
])
def test_a_mistyped_observatory_metric_is_refused_when_the_study_is_loaded(tmp_path, key, metric, message):
    # at judging it would read "no score" for every run; normlab-study refuses it before any run, in one line
    import subprocess
    import sys

    from study_files import write_study_file

    path = write_study_file(tmp_path, [claim(metric="obs.dec.sink"), claim(id="d", **{key: metric})])
    r = subprocess.run([sys.executable, "-m", "normlab.commands.study", str(path), "--report-only", "--out",
                        str(tmp_path / "o"), "--runs", str(tmp_path / "r")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith(f"error: s.yaml: claims[1].{key}: {message}"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
