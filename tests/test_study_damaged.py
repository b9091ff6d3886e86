"""A damaged file in a study's records or run folders (issue 37 item 6: a results.json cut off or not
a JSON object, a seed that is not an integer, a metrics.csv cell that is not a number, a test.hyp.gz
that is not gzip) is named in one line and treated as missing; --status, --report-only, the claims and
a study's run go on with the other records, and the damaged file is left byte for byte as it was.

The study: arms a and b, seeds 1 and 2, every run recorded; a-s1 (or b-s1's run folder) is damaged."""
import csv
import gzip
import json
import os
import shutil
from pathlib import Path

import pytest

from normlab.commands import study as study_cmd
from normlab.study.claims import judge, read_refs
from normlab.study.records import Record, load_records
from normlab.study.plan import plan
from normlab.study.runner import adopt_shared
from normlab.study.spec import load_study
from normlab.study.stats import corpus_bleu, sentence_stats

STUDY = """title: t
paper: p
question: q
seeds: [1, 2]
plateau: {window: 4, min_delta: 0.01, cap: 8}
table: [test_bleu, end.train_nll]
arms:
  a: {overrides: [norm=prenorm]}
  b: {overrides: [norm=postnorm]}
claims:
  - {id: c, claim: a beats b, source: s, paper: '+1', better: a, than: b, interval: bootstrap}
"""
REFS = ["the cat sat on the mat", "a dog ran in the park", "it is a fine day today"]
HYPS = {"a": ["the cat sat on the mat", "a dog ran in a park", "it is a fine day"],
        "b": ["the cat sat on a mat", "a dog ran", "it is fine today"]}


def bleu(arm: str, seed: int) -> float:
    # the corpus BLEU of the arm's translations (the test-set check recomputes it), a seed apart by 0.001
    return float(corpus_bleu(sentence_stats(HYPS[arm], REFS).sum(0))) + 0.001 * seed


def metrics_csv(seed: int) -> str:
    rows = ["epoch,step,train/loss,train/nll,valid/loss"]
    rows += [f"0,{s},{5 - 0.1 * s},{5 - 0.1 * s + 0.01 * seed},{6 - 0.2 * s if s % 2 else ''}" for s in range(8)]
    return "\n".join(rows) + "\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The study file, every record and the references, built once (plan composes each arm)."""
    root = tmp_path_factory.mktemp("base")
    (root / "st.yaml").write_text(STUDY)
    jobs = plan(load_study(str(root / "st.yaml"), "smoke"), root / "runs", root / "out")
    (root / "out").mkdir()
    with gzip.open(root / "out" / "test.ref.gz", "wt") as f:
        f.write("\n".join(REFS) + "\n")
    for job in jobs:
        arm, seed = job.arm.name, job.seed
        job.record.mkdir(parents=True)
        (job.record / "results.json").write_text(json.dumps({
            "status": "completed", "identity_hash": job.identity_hash, "test_bleu": bleu(arm, seed), "steps": 8,
            "wall_s": 60.0, "study": {"arm": arm, "seed": seed, "jobs": 1}}))
        with gzip.GzipFile(job.record / "test.hyp.gz", "wb", mtime=0) as f:
            f.write(("\n".join(HYPS[arm]) + "\n").encode())
        (job.record / "metrics.csv").write_text(metrics_csv(seed))
    return root, {j.tag: j.run_dir.name for j in jobs}


def edit(**kw):
    return lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), **kw}))


def keep_bytes(n):
    return lambda p: p.write_bytes(p.read_bytes()[:n])


def replace(old, new):
    return lambda p: p.write_text(p.read_text().replace(old, new, 1))


NOT_RECORDED = "treated as not recorded and left as it is (move it away, or restore it, for the study to run it again)"
NO_SERIES = "treated as missing: its logged series (curves, plateau, end.* values) are left out"
NO_HYPS = "its translations are left out (no test-set check over sentences with it)"
# (case, the file under a-s1, damage, the one line's problem and what the study does)
RECORD = [
    ("cut off", "results.json", keep_bytes(40), "not JSON (cut off at byte 40?)"),
    ("empty", "results.json", keep_bytes(0), "empty"),
    ("a list", "results.json", lambda p: p.write_text("[1, 2]"), "a JSON list, not a JSON object"),
    ("a string", "results.json", lambda p: p.write_text('"completed"'), "a JSON string, not a JSON object"),
    ("seed one", "results.json", edit(study={"arm": "a", "seed": "one"}), "study.seed 'one' is not an integer"),
    ("no seed", "results.json", edit(study={"arm": "a"}), "no seed (study.seed)"),
    ("float seed", "results.json", edit(study={"arm": "a", "seed": 1.5}), "study.seed 1.5 is not an integer"),
    ("study a list", "results.json", edit(study=["a", 1]), "study is a JSON list, not an object"),
    ("wall_s text", "results.json", edit(wall_s="1h"), "wall_s '1h' is not a number"),
    ("steps negative", "results.json", edit(steps=-8), "steps -8 is negative"),
    ("status a list", "results.json", edit(status=["completed"]), "status is a JSON list, not a run status"),
    ("identity a number", "results.json", edit(identity_hash=5), "identity_hash 5 is not a hash"),
    ("rung text", "results.json", edit(rung="abc"), "rung 'abc' is not a step"),
    ("a folder", "results.json", lambda p: (p.unlink(), p.mkdir()), "unreadable (Is a directory)"),
    ("record a file", "results.json", lambda p: (shutil.rmtree(p.parent), p.parent.write_text("x")),
     "unreadable (Not a directory)"),
    ("rung past its steps", "results.json", edit(status="stopped", rung=500),
     "rung 500 is past the run's steps (8): a paused run is at its rung or past it"),
]
SERIES = [
    ("valid/loss text", "metrics.csv", replace(",5.8\n", ",abc\n"), "line 3: valid/loss 'abc' is not a number"),
    ("train/loss text", "metrics.csv", replace("0,1,4.9,", "0,1,x,"), "line 3: train/loss 'x' is not a number"),
    ("step text", "metrics.csv", replace("0,3,", "0,three,"), "line 5: step 'three' is not an integer"),
]
HYPOTHESES = [
    ("plain text", "test.hyp.gz", lambda p: p.write_text("the cat\n"), "not a gzip file"),
    ("random bytes", "test.hyp.gz", lambda p: p.write_bytes(b"\xa2\xe9" + os.urandom(200)), "not a gzip file"),
    ("cut off gzip", "test.hyp.gz", keep_bytes(30), "cut off (its gzip stream ends early)"),
]
CASES = ([(*c, NOT_RECORDED) for c in RECORD] + [(*c, NO_SERIES) for c in SERIES]
         + [(*c, NO_HYPS) for c in HYPOTHESES])


def damage(base, tmp_path, file, fn) -> tuple[Path, Path]:
    """A copy of the study with a-s1's file damaged: (the study folder, the damaged file)."""
    root = tmp_path / "study"
    shutil.copytree(base[0], root)
    path = root / "out" / "runs" / "a-s1" / file
    fn(path)
    return root, path


def files(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run(root: Path, capsys, *flags) -> tuple[int, str, str]:
    code = study_cmd.main([str(root / "st.yaml"), "study.budget=smoke", *flags, "--out", str(root / "out"),
                           "--runs", str(root / "runs")])
    out, err = capsys.readouterr()
    return code, out, err


def named_once(err: str, path: Path, problem: str, then: str) -> None:
    lines = [line for line in err.splitlines() if str(path) in line]
    assert lines == [f"warning: {path}: {problem}: {then}"], err


def check_verdict(claim: dict, case: str, kind: list) -> None:
    """The claim is still judged on the records that are not damaged."""
    if kind is RECORD:  # a-s1 not recorded: a s2 against b s2
        assert claim["statuses"] == {"a": {"completed": 1}, "b": {"completed": 2}}
        assert claim["difference"]["paired_seeds"] == 1
        assert claim["means"]["a"] == pytest.approx(bleu("a", 2))
        assert claim["test_set_check"] is not None  # the other records' translations still read
    else:
        assert claim["statuses"] == {"a": {"completed": 2}, "b": {"completed": 2}}
        assert claim["difference"]["paired_seeds"] == 2
        assert claim["difference"]["mean"] == pytest.approx(bleu("a", 1) - bleu("b", 1))
    if kind is SERIES:  # a s1's curve missing: its plateau is not known
        assert "plateau not known (no valid/loss curve): a s1" in claim["note"]
    else:
        assert "plateau not known" not in claim["note"]
    if kind is HYPOTHESES:
        assert claim["test_set_check"] is None and "no test hypotheses" in claim["note"]


def kind_of(case: str) -> list:
    return next(k for k in (RECORD, SERIES, HYPOTHESES) if any(c[0] == case for c in k))


@pytest.mark.integration
@pytest.mark.parametrize("case, file, fn, problem, then", CASES, ids=[c[0] for c in CASES])
def test_report_only_names_the_file_and_judges_the_rest(base, tmp_path, capsys, case, file, fn, problem, then):
    root, path = damage(base, tmp_path, file, fn)
    before = files(root / "out" / "runs")
    code, out, err = run(root, capsys, "--report-only")
    assert code == 0 and "Traceback" not in err
    named_once(err, path, problem, then)
    assert files(root / "out" / "runs") == before  # the damaged file and every other record as they were
    kind = kind_of(case)
    check_verdict(json.loads((root / "out" / "claims.json").read_text())["claims"][0], case, kind)
    # end.train_nll: train/nll over the last tenth of the steps (step 7 of 0..7): 5 - 0.7 + 0.01 x seed
    table = {(r["arm"], r["seed"]): r["end.train_nll"]
             for r in csv.DictReader((root / "out" / "table.csv").read_text().splitlines())}
    assert float(table["a", "2"]) == pytest.approx(4.32)
    if kind is RECORD:
        assert ("a", "1") not in table
    else:
        assert table["a", "1"] == "" if kind is SERIES else float(table["a", "1"]) == pytest.approx(4.31)


@pytest.mark.parametrize("case, file, fn, problem, then", CASES, ids=[c[0] for c in CASES])
def test_the_claims_judge_the_records_that_are_not_damaged(base, tmp_path, capsys, case, file, fn, problem, then):
    root, path = damage(base, tmp_path, file, fn)
    study = load_study(str(root / "st.yaml"), "smoke")
    verdicts = judge(study, load_records(root / "out"), read_refs(root / "out" / "test.ref.gz"))
    named_once(capsys.readouterr().err, path, problem, then)
    check_verdict(verdicts[0].as_dict(), case, kind_of(case))


def test_the_undamaged_study_has_every_check(base, tmp_path, capsys):
    root, _ = damage(base, tmp_path, "results.json", lambda p: None)
    study = load_study(str(root / "st.yaml"), "smoke")
    (v,) = judge(study, load_records(root / "out"), read_refs(root / "out" / "test.ref.gz"))
    assert v.check is not None and "plateau not known" not in v.note and v.interval.n == 2
    assert capsys.readouterr().err == ""


@pytest.mark.integration
@pytest.mark.parametrize("case, file, fn, problem, then", [(*c, NOT_RECORDED) for c in RECORD],
                         ids=[c[0] for c in RECORD])
def test_status_names_a_damaged_record_and_changes_nothing(base, tmp_path, capsys, case, file, fn, problem, then):
    root, path = damage(base, tmp_path, file, fn)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    code, out, err = run(root, capsys, "--status")
    assert code == 0 and "Traceback" not in err
    named_once(err, path, problem, then)
    lines = out.splitlines()
    assert lines[0] == "st (smoke): 4 runs planned: 3 recorded, 1 damaged, 0 not started"
    assert lines[1] == "  a seed 1  its record's results.json is damaged (see its warning): not run while it is there"
    assert all(" recorded: status completed" in line for line in lines[2:5])
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


RUN_FOLDER = [("a list", lambda p: p.write_text('["x"]'), "a JSON list, not a JSON object"),
              ("cut off", lambda p: p.write_text('{"status": "comp'), "not JSON (cut off at byte 16?)"),
              ("steps text", lambda p: p.write_text('{"status": "stopped", "steps": "x"}'),
               "steps 'x' is not a number")]


@pytest.mark.integration
@pytest.mark.parametrize("case, fn, problem", RUN_FOLDER, ids=[c[0] for c in RUN_FOLDER])
def test_status_names_a_damaged_run_folder(base, tmp_path, capsys, case, fn, problem):
    # b s1 not recorded yet; its run folder's results.json is damaged
    root, _ = damage(base, tmp_path, "results.json", lambda p: None)
    shutil.rmtree(root / "out" / "runs" / "b-s1")
    path = root / "runs" / base[1]["b seed 1"] / "results.json"
    path.parent.mkdir(parents=True)
    fn(path)
    before = path.read_bytes()
    code, out, err = run(root, capsys, "--status")
    assert code == 0 and "Traceback" not in err
    named_once(err, path, problem, "the run is treated as not finished and left as it is (move the file away for "
                                   "the study to continue it)")
    assert out.splitlines()[2] == ("  b seed 1  its run folder's results.json is damaged (see its warning): not run "
                                   "while it is there")
    assert path.read_bytes() == before


@pytest.mark.integration
def test_a_study_run_leaves_the_damaged_record_and_runs_nothing(base, tmp_path, capsys):
    root, path = damage(base, tmp_path, "results.json", keep_bytes(40))
    before = files(root / "out" / "runs")
    code, out, err = run(root, capsys, "--jobs", "1")
    assert code == 1 and "Traceback" not in err
    named_once(err, path, "not JSON (cut off at byte 40?)", NOT_RECORDED)
    assert "3 already recorded, 0 to run, 1 at a time; 1 left out (a seed 1: a damaged results.json" in out
    assert err.splitlines()[-1].startswith("1 run(s) not run: their results.json is damaged")
    assert files(root / "out" / "runs") == before and not list((root / "runs" / "logs").iterdir())  # nothing trained
    claim = json.loads((root / "out" / "claims.json").read_text())["claims"][0]
    check_verdict(claim, "cut off", RECORD)


def test_a_damaged_record_is_not_replaced_by_another_studys_copy(base, tmp_path, capsys):
    root, path = damage(base, tmp_path, "results.json", keep_bytes(40))
    good = json.loads((base[0] / "out" / "runs" / "a-s1" / "results.json").read_text())
    other = root / "experiments" / "other" / "runs" / "a-s1"
    other.mkdir(parents=True)
    (other / "results.json").write_text(json.dumps({**good, "group": "study-other"}))
    jobs = plan(load_study(str(root / "st.yaml"), "smoke"), root / "runs", root / "out")
    assert adopt_shared(jobs, root / "experiments", lambda s: None) == []
    assert path.read_bytes() == (base[0] / "out" / "runs" / "a-s1" / "results.json").read_bytes()[:40]
    named_once(capsys.readouterr().err, path, "not JSON (cut off at byte 40?)", NOT_RECORDED)


def test_a_damaged_prune_table_or_reference_file_is_left_out(tmp_path, capsys):
    rec = Record(tmp_path, "a", 1, {"status": "completed"})
    (tmp_path / "prune.json").write_text('{"rows": [{"strategy": "every_other", "kept": 3, "test_bleu": 2')
    assert rec.prune_metric("prune.every_other.r3.test_bleu") is None
    ref = tmp_path / "test.ref.gz"
    ref.write_bytes(b"the cat sat\n")
    assert read_refs(ref) is None
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {tmp_path / 'prune.json'}: not JSON (cut off at byte 63?): its pruned models' scores are left out",
        f"warning: {ref}: not a gzip file: no test-set check over sentences (the references)"]
