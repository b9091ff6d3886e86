"""normlab-study NAME --verify RUN [--steps N]: a record's first steps rerun at its settings, thread
count and code give its logged losses to the bit; an altered record fails, naming the step and both
values; a record of another commit is rerun at that commit's code (paused by stop_at_step, or by
SIGTERM where the code predates it); what a difference can come from is read from the record (code,
kernel path, threads), and what the rerun could not take from it is said."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from normlab.commands.study import main
from normlab.errors import UserError, report
import normlab.provenance as provenance
from normlab.provenance import changed_since, code_version, first_committed
from normlab.study import verify as verify_mod
from normlab.study.verify import (RerunCode, compare, logged_losses, record_legs, rerun_code, rerun_env,
                                  steps_to_compare)
from normlab.study.verify_why import conclusion, reasons

ROOT = Path(__file__).resolve().parents[1]
STUDY = """title: verify
paper: p
question: q
seeds: [1]
budgets: {{smoke: {{seeds: [1]}}}}
common: [{common}]
arms:
  pre: {{overrides: [norm=prenorm]}}
claims:
  - {{id: trains, claim: pre trains, source: s, paper: '-', better: pre, kind: trains}}
"""


def run_study(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "normlab.commands.study", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def study(capsys, *args):
    """The command in this process, as its console script ends: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = main(list(map(str, args)))
    except UserError as e:
        code = report(e)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def smoke(small_corpus, tmp_path_factory):
    """A one-run smoke study on the small corpus, trained here, its losses logged at every step."""
    tmp = tmp_path_factory.mktemp("verify")
    common = [f"data.{k}={v}" for k, v in small_corpus.items()] + [
        "data.vocab_size=300", f"data.cache_dir={tmp / 'cache'}", "trainer.log_every_n_steps=1", "eval.test=false",
        "eval.valid_bleu=false"]
    study = tmp / "verify_study.yaml"
    study.write_text(STUDY.format(common=", ".join(common)))
    base = [study, "study.budget=smoke", "--out", tmp / "out", "--runs", tmp / "runs"]
    r = run_study(*base)
    assert r.returncode == 0, r.stdout + r.stderr
    return base, tmp / "out" / "runs" / "pre-s1"


def test_a_record_trained_here_verifies_to_the_bit(smoke):
    base, record = smoke
    r = run_study(*base, "--verify", "pre-s1", "--steps", 4)  # the console script, as a user runs it
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verified: 4 of 4 logged losses equal to the bit (train/loss, train/nll at metrics.csv steps 0..3)" in r.stdout
    threads = re.search(r"(\d+) threads?\"", (record / "results.json").read_text()).group(1)
    rerun = re.search(r" in (\S+) \((\d+) thread\(s\)\)", r.stdout)
    assert rerun.group(2) == threads  # the record's thread count (the study's: this machine's cores / 2 jobs)
    assert not Path(rerun.group(1)).exists()  # verified: its temporary folder is gone


def test_an_altered_record_fails_naming_the_step_and_both_values(smoke, tmp_path, capsys):
    base, record = smoke
    altered = tmp_path / "pre-s1"
    shutil.copytree(record, altered)
    metrics = (altered / "metrics.csv").read_text().splitlines()
    true = logged_losses(record / "metrics.csv")[2]["train/loss"]
    fake = repr(float(true) * (1 + 1e-6))
    row = next(i for i, line in enumerate(metrics) if line.split(",")[1] == "2" and true in line)
    metrics[row] = metrics[row].replace(true, fake)
    (altered / "metrics.csv").write_text("\n".join(metrics) + "\n")
    code, out, err = study(capsys, *base, "--verify", altered, "--steps", 4)
    assert code == 1, out + err
    assert (f"differs: step 2 (metrics.csv) train/loss: record {fake}, rerun {true}, relative difference 1.0e-06; "
            "2 of 4 logged steps before it equal") in out
    assert "why it may differ:" in out and "kernel path: the record's (" in out  # same CPU: not a cause
    if not code_version()["dirty"]:  # the record's code is this checkout's: nothing it names differs
        assert "code: src/ and conf/ are the record's commit" in out
        assert out.strip().splitlines()[-1].startswith("so: nothing the record names differs"), out
    kept = Path(out.split("kept: ", 1)[1].splitlines()[0])
    assert (kept / "run" / "csv" / "metrics.csv").is_file()  # the rerun kept for a look
    shutil.rmtree(kept)


def test_bad_arguments_are_one_line_errors(smoke, tmp_path, capsys):
    base, record = smoke
    r = run_study(*base, "--verify", "nosuch")
    assert r.returncode == 2 and r.stderr.startswith("error: --verify: 'nosuch' is not a record of ") and "Traceback" \
        not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.strip().endswith("(allowed: pre-s1)")  # the study's records
    for args, msg in ((["--steps", "4"], "error: --steps: only with --verify RUN"),
                      (["--verify", "pre-s1", "--steps", "0"], "error: --steps: 0 must be >= 1"),
                      (["--verify", "pre-s1", "--status"], "error: --verify: trains a copy of one record")):
        code, out, err = study(capsys, *base, *args)
        assert code == 2 and err.startswith(msg) and len(err.strip().splitlines()) == 1, err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "results.json").write_text("{not json")
    code, out, err = study(capsys, *base, "--verify", broken)
    assert code == 2 and err.startswith(f"error: {broken}/results.json: not a readable record: ") and \
        len(err.strip().splitlines()) == 1, err
    code, out, err = study(capsys, "nosuch_study", "--verify", "pre-s1")  # a bad NAME: the studies
    assert code == 2 and err.startswith("error: study 'nosuch_study': no such study (allowed: ") and "deep_bleu" in err
    code, out, err = study(capsys, "output_change", "--verify", "pre-s1")  # a probe: the studies with runs
    assert code == 2 and err.startswith("error: --verify: output_change is a probe study: it records no training "
                                        "runs (allowed: ") and "deep_bleu" in err and "output_change," not in err, err


@pytest.mark.slow  # make test: test_steps_to_compare checks the rule; this runs it end to end (make test-slow)
def test_steps_before_the_first_logged_loss_rerun_to_it(smoke, tmp_path, capsys):
    base, record = smoke
    sparse = tmp_path / "pre-s1"
    shutil.copytree(record, sparse)  # as a full-budget record logs (every 25 steps): its first loss at step 4
    lines = (sparse / "metrics.csv").read_text().splitlines()
    (sparse / "metrics.csv").write_text("\n".join([lines[0]] + [ln for ln in lines[1:] if ln.split(",")[1] == "3"]) + "\n")
    code, out, err = study(capsys, *base, "--verify", sparse, "--steps", 2)
    assert code == 0, out + err
    assert out.startswith("rerunning the first 4 steps of ") and "--steps 2: pre-s1 logged its first loss at step 4, so 4" in out
    assert "verified: 1 of 1 logged losses equal to the bit (train/loss, train/nll at metrics.csv steps 3..3)" in out


def _exported_head(monkeypatch, strip_stop_at=False):
    """The record's commit (HEAD) as one this checkout differs from, so verify exports it; with
    strip_stop_at, exported as code from before stop_at_step (paused by SIGTERM, pause_at.py)."""
    head = code_version()["commit"]
    monkeypatch.setattr(provenance, "changed_since", lambda c: ["src/normlab/x.py"] if c == head else None)
    real = provenance.export_code

    def export(commit, dest):
        ok = real(commit, dest)
        pre = Path(dest) / "conf" / "callbacks" / "preemption.yaml"
        if strip_stop_at:
            pre.write_text("".join(ln for ln in pre.read_text().splitlines(True) if "stop_at_step" not in ln))
        return ok
    monkeypatch.setattr(provenance, "export_code", export)
    monkeypatch.setattr(verify_mod.shutil, "rmtree", lambda *a, **k: None)  # keep the verified rerun for a look
    return head


@pytest.mark.slow  # make test: test_which_code_the_rerun_runs checks the code and pause chosen; this runs them
@pytest.mark.skipif(code_version()["dirty"] is not False, reason="HEAD is not the code that trained the record")
def test_a_record_of_another_commit_reruns_at_its_code_paused_by_sigterm_before_stop_at_step(smoke, capsys,
                                                                                            monkeypatch):
    base, record = smoke
    head = _exported_head(monkeypatch, strip_stop_at=True)
    code, out, err = study(capsys, *base, "--verify", "pre-s1", "--steps", 3)
    assert code == 0, out + err
    assert (f"at the record's commit {head[:8]} (its src/ and conf/ from git: this checkout's differ in 1 file(s)), "
            "paused by SIGTERM after the steps (it has no stop_at_step)") in out
    assert "verified: 3 of 3 logged losses equal to the bit" in out
    run_dir = Path(re.search(r" in (\S+) \(", out).group(1))
    mine = json.loads((run_dir / "run" / "results.json").read_text())
    # the exported code ran (no .git beside it: it names no commit), paused by its preemption path
    assert mine["code"]["commit"] is None and mine["status"] == "preempted" and mine["steps"] in (3, 4), mine
    assert (run_dir / "code" / "pause" / "normlab_verify_pause.py").is_file()
    monkeypatch.undo()  # rmtree again
    shutil.rmtree(run_dir)


# ---- the pieces, without training -------------------------------------------------------------

def test_compare_is_exact_and_names_the_first_difference():
    rec = {0: {"train/loss": "9.5", "train/nll": "9.25"}, 4: {"train/loss": "8.0", "train/nll": "7.5"},
           9: {"train/loss": "7.0", "train/nll": "6.0"}}
    assert compare(rec, dict(rec), 9).lines == [
        "verified: 2 of 2 logged losses equal to the bit (train/loss, train/nll at metrics.csv steps 0..4)"]
    v = compare(rec, {0: rec[0], 4: {"train/loss": "8.0", "train/nll": "7.500001"}}, 10)
    assert not v.equal and v.lines == ["differs: step 4 (metrics.csv) train/nll: record 7.5, rerun 7.500001, "
                                       "relative difference 1.3e-07; 1 of 3 logged steps before it equal"]
    v = compare(rec, {0: rec[0]}, 10)  # the rerun logged less than the record
    assert not v.equal and "step 4 (metrics.csv) train/loss: record 8.0, rerun None;" in v.lines[0]


def test_the_rerun_takes_the_records_threads_and_kernel_path():
    here = {"capability": "AVX2"}
    res = {"device": "cpu: x86_64, AMD EPYC, AVX2 kernels, 2 cores, 3 threads",
           "cpu": {"capability": "DEFAULT", "mkl": "2024.2, MKL_CBWR=AVX2", "onednn": "3.12.0, auto"}}
    env, notes = rerun_env(res, here, {"OMP_NUM_THREADS": "7"})
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["MKL_CBWR"]) == ("3", "3", "AVX2")
    assert env["ATEN_CPU_CAPABILITY"] == "default" and "ONEDNN_MAX_CPU_ISA" not in env
    assert notes == ["ATen kernels DEFAULT as the record's (ATEN_CPU_CAPABILITY=default; this CPU's: AVX2)"]
    env, _ = rerun_env(res, here, {"ATEN_CPU_CAPABILITY": "avx2"})  # the user's choice stands
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    env, _ = rerun_env({**res, "cpu": {"capability": "AVX512"}}, here, {})  # a path this CPU lacks: its own
    assert "ATEN_CPU_CAPABILITY" not in env
    # no thread count recorded: the study's split of this machine for the record's jobs
    env, notes = rerun_env({"study": {"jobs": 2}}, here, {})
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2)) and "names no thread count" in notes[0]
    # ... nor its jobs (one job: torch's own count, or the one this environment sets)
    env, notes = rerun_env({"study": {}}, here, {})
    assert "OMP_NUM_THREADS" not in env and notes == ["the record names no thread count: rerun with torch's default"]
    env, notes = rerun_env({"study": {}}, here, {"OMP_NUM_THREADS": "1"})
    assert env["OMP_NUM_THREADS"] == "1" and notes == [
        "the record names no thread count: rerun with OMP_NUM_THREADS=1 as set here"]


def test_reasons_name_what_the_record_lacks_or_had_otherwise():
    mine = {"identity_hash": "aaaa", "code": code_version(), "cpu": {"model": "M", "capability": "AVX2"},
            "device": "cpu: x86_64, M, AVX2 kernels, 2 cores, 1 thread"}
    old = {"identity_hash": "aaaa", "device": "cpu: x86_64, 2 cores, 1 thread"}  # before code and cpu were recorded
    lines = reasons(old, mine, 20)
    assert lines[0].startswith("code: the record names none: trained before its code was recorded")
    assert lines[1].startswith("kernel path: the record names none (trained before results.json had `cpu`")
    assert len(lines) == 2  # same settings, same thread count
    assert conclusion(old, mine, 20, RerunCode([])) == ("so: not reproducible to the bit here: the rerun lacks the "
                                                        "code it trained at (not recorded); its kernel path (not recorded)")
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()[0]
    other = {"identity_hash": "bbbb", "code": {"commit": first, "torch": "0.1"}, "cpu": {"model": "X", "capability": "AVX512"},
             "device": "cpu: x86_64, X, AVX512 kernels, 8 cores, 4 threads"}
    lines = reasons(other, mine, 20)
    assert lines[0].startswith("settings: the record's overrides compose to another run here (identity aaaa, recorded bbbb)")
    assert lines[1].startswith("code: the record names its last leg's code only (trained before results.json had code_legs)")
    assert lines[2].startswith(f"code: the record's commit is {first[:8]}, this rerun's ") and "differ (" in lines[2]
    assert lines[3] == f"torch: the record's 0.1, this rerun's {mine['code']['torch']}"
    assert lines[4].startswith("kernel path: the record's X, AVX512 kernels") and lines[5] == "threads: record 4, rerun 1"
    assert changed_since("0" * 40) is None  # not in this clone
    # rerun at the record's commit: the code is not a cause, what is left is the CPU
    at = RerunCode([], commit=first, root=Path("x"))
    same = {**other, "identity_hash": "aaaa", "code_legs": [{"from_step": 0, "commit": first, "dirty": False}]}
    assert reasons(same, mine, 20, None, at)[0] == f"code: rerun at the record's commit {first[:8]}: not a cause"
    assert conclusion(same, mine, 20, at) == "so: not reproducible to the bit here: the rerun lacks its CPU's kernel path"
    exact = {**same, "cpu": mine["cpu"], "device": mine["device"]}
    assert conclusion(exact, mine, 20, at).startswith("so: nothing the record names differs")
    dirty = {**exact, "code_legs": [{"from_step": 0, "commit": first, "dirty": True}]}
    assert conclusion(dirty, mine, 20, RerunCode([])).endswith("the rerun lacks its uncommitted changes")


def test_the_legs_that_trained_the_first_steps():
    legs = [{"from_step": 0, "commit": "a", "dirty": False}, {"from_step": 4, "commit": "b", "dirty": False},
            {"from_step": 30, "commit": "c", "dirty": False}]
    assert [(g["commit"], g["n"]) for g in record_legs({"code_legs": legs}, 25)] == [("a", 4), ("b", 21)]
    assert [(g["commit"], g["n"]) for g in record_legs({"code_legs": legs}, 3)] == [("a", 3)]
    # before code_legs: the record's code (its last leg's) from step 0; before `code`: none
    assert record_legs({"code": {"commit": "z", "dirty": False}}, 25) == [{"from_step": 0, "commit": "z", "dirty": False,
                                                                          "n": 25}]
    assert record_legs({}, 25) == [{"from_step": 0, "commit": None, "n": 25}]


def test_steps_to_compare():
    logged = {24: {"train/loss": "8.5"}, 49: {"train/loss": "7.4"}}
    assert steps_to_compare(logged, 50, "r") == (50, [])
    assert steps_to_compare(logged, 25, "r") == (25, [])  # metrics.csv step 24: the loss of step 25
    assert steps_to_compare(logged, 20, "r") == (25, ["--steps 20: r logged its first loss at step 25, so 25"])


def test_which_code_the_rerun_runs(tmp_path, monkeypatch):
    def fake_export(stop_at: bool):
        def export(commit, dest):
            (Path(dest) / "conf" / "callbacks").mkdir(parents=True)
            (Path(dest) / "conf" / "callbacks" / "preemption.yaml").write_text(
                "preemption:\n  signals: [SIGTERM]\n" + ("  stop_at_step: null\n" if stop_at else ""))
            return True
        return export

    legs = {"code_legs": [{"from_step": 0, "commit": "a" * 40, "dirty": False},
                          {"from_step": 5, "commit": "b" * 40, "dirty": False}]}
    monkeypatch.setattr(provenance, "changed_since", lambda c: ["src/normlab/x.py"])
    monkeypatch.setattr(provenance, "export_code", fake_export(stop_at=True))
    code = rerun_code(legs, 25, tmp_path / "new")  # the leg that trained most of the 25 steps: b
    assert (code.commit, code.root, code.by_signal) == ("b" * 40, tmp_path / "new", False)
    assert code.pause == ["callbacks.preemption.stop_at_step=25"]
    assert rerun_code(legs, 4, tmp_path / "new4").commit == "a" * 40
    monkeypatch.setattr(provenance, "export_code", fake_export(stop_at=False))  # code before stop_at_step
    code = rerun_code(legs, 25, tmp_path / "old")
    assert code.by_signal and code.pause == ["+callbacks.verify_pause._target_=normlab_verify_pause.PauseAt",
                                             "+callbacks.verify_pause.step=25"]
    assert (tmp_path / "old" / "pause" / "normlab_verify_pause.py").read_text() == \
        (ROOT / "src" / "normlab" / "study" / "pause_at.py").read_text()
    # this checkout's code: the same as the record's, a commit not in this clone, uncommitted changes, none named
    for changed, res in (([], legs), (None, legs), (["x"], {"code_legs": [{**legs["code_legs"][0], "dirty": True}]}),
                         (["x"], {})):
        monkeypatch.setattr(provenance, "changed_since", lambda c, changed=changed: changed)
        code = rerun_code(res, 25, tmp_path / "here")
        assert code.root is None and code.pause == ["callbacks.preemption.stop_at_step=25"], (changed, res)
    assert not (tmp_path / "here").exists()


def test_first_committed_follows_renames_not_similar_records(tmp_path, monkeypatch):
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    record = "".join(f'"key{i}": {i},\n' for i in range(40))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.json").write_text("{" + record + '"seed": 1}\n')
    git("add", ".")
    git("commit", "-qm", "a record")
    (tmp_path / "old").mkdir()  # another record, alike, added as the first is deleted
    (tmp_path / "old" / "results.json").write_text("{" + record + '"seed": 2}\n')
    git("rm", "-q", "a/results.json")
    git("add", ".")
    git("commit", "-qm", "a second record replaces the first")
    added = git("rev-parse", "--short=8", "HEAD")
    git("mv", "old", "new")
    git("commit", "-qm", "the study's folder moved")
    monkeypatch.setattr(provenance, "ROOT", tmp_path.resolve())
    assert first_committed(tmp_path / "new" / "results.json").startswith(f"{added} on ")
