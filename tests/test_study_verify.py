"""normlab-study NAME --verify RUN [--steps N]: a record's first steps rerun at its settings and
thread count give its logged losses to the bit; an altered record fails, naming the step and both
values; what a difference can come from is read from the record (code, kernel path, threads)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from normlab.commands.study import main
from normlab.errors import UserError, report
from normlab.provenance import changed_since, code_version
from normlab.study.verify import compare, logged_losses, reasons, rerun_env

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
    kept = Path(out.split("kept: ", 1)[1].splitlines()[0])
    assert (kept / "run" / "csv" / "metrics.csv").is_file()  # the rerun kept for a look
    shutil.rmtree(kept)


def test_bad_arguments_are_one_line_errors(smoke, capsys):
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


def test_steps_before_the_first_logged_loss_are_an_error(smoke, tmp_path, capsys):
    base, record = smoke
    sparse = tmp_path / "pre-s1"
    shutil.copytree(record, sparse)  # as a full-budget record: a loss every 25 steps, the first at 25
    lines = (sparse / "metrics.csv").read_text().splitlines()
    (sparse / "metrics.csv").write_text("\n".join([lines[0]] + [ln.replace(",0,", ",24,", 1) for ln in lines[1:2]]) + "\n")
    code, out, err = study(capsys, *base, "--verify", sparse, "--steps", 20)
    assert code == 2 and err.strip() == (
        "error: --steps: 20: pre-s1 logged its first loss at step 25 (metrics.csv step 24): nothing to compare "
        "before it (allowed: 25 or more)"), err


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


def test_reasons_name_what_the_record_lacks_or_had_otherwise():
    mine = {"identity_hash": "aaaa", "code": code_version(), "cpu": {"model": "M", "capability": "AVX2"},
            "device": "cpu: x86_64, M, AVX2 kernels, 2 cores, 1 thread"}
    old = {"identity_hash": "aaaa", "device": "cpu: x86_64, 2 cores, 1 thread"}  # before code and cpu were recorded
    lines = reasons(old, mine, 20)
    assert lines[0].startswith("code: the record names none: trained before its code was recorded")
    assert lines[1].startswith("kernel path: the record names none (trained before results.json had `cpu`")
    assert len(lines) == 2  # same settings, same thread count
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()[0]
    other = {"identity_hash": "bbbb", "code": {"commit": first, "torch": "0.1"}, "cpu": {"model": "X", "capability": "AVX512"},
             "device": "cpu: x86_64, X, AVX512 kernels, 8 cores, 4 threads"}
    lines = reasons(other, mine, 20)
    assert lines[0].startswith("settings: the record's overrides compose to another run here (identity aaaa, recorded bbbb)")
    assert lines[1].startswith(f"code: the record's commit is {first[:8]}, this rerun's ") and "differ (" in lines[1]
    assert lines[2] == f"torch: the record's 0.1, this rerun's {mine['code']['torch']}"
    assert lines[3].startswith("kernel path: the record's X, AVX512 kernels") and lines[4] == "threads: record 4, rerun 1"
    assert changed_since("0" * 40) is None  # not in this clone
