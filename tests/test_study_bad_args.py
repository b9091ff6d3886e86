"""normlab-study's bad input is one line, exit 2, before any work: a damaged record given to --verify
(results.json fields of the wrong type, a metrics.csv that is not the logger's), a file given as
--out or --runs, an empty study.budget=; and --verify's temporary folder is gone on every way out
but the two that name it (a rerun that differs, or failed)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from normlab.commands.study import parse
from normlab.errors import EXIT_USER_ERROR, UserError, report
from normlab.study import verify as verify_mod
from normlab.study.spec import load_study
from normlab.study.verify import verify

ROOT = Path(__file__).resolve().parents[1]
RESULTS = {"study": {"overrides": ["trainer.max_steps=4"], "jobs": 1}, "device": "cpu: x86_64, 1 thread",
           "code": {"commit": None, "dirty": None}, "status": "finished"}
METRICS = "epoch,step,train/loss,train/nll\n0,0,8.5,8.4\n0,1,8.25,8.125\n"


def make_record(folder: Path, results=None, metrics: bytes | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(RESULTS if results is None else results))
    (folder / "metrics.csv").write_bytes(METRICS.encode() if metrics is None else metrics)
    return folder


def one_line(capsys, err: UserError) -> tuple[int, str]:
    """As the console script ends on a user error: (exit status, stderr)."""
    capsys.readouterr()
    code = report(err)
    return code, capsys.readouterr().err


@pytest.fixture
def tmpdir_here(tmp_path, monkeypatch):
    """tempfile's folder (TMPDIR) in tmp_path, to see what --verify leaves there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(verify_mod.tempfile, "tempdir", str(tmp))
    return tmp


def _with(**changes):
    def change(res):
        for dotted, value in changes.items():
            *path, last = dotted.split(".")
            node = res
            for key in path:
                node = node[key]
            if value is KeyError:
                node.pop(last)
            else:
                node[last] = value
        return res
    return change


BAD_RESULTS = {  # how the record is damaged: the line after `error: <record>/results.json: `
    "a list": (lambda r: [r], "a list, not a record (allowed: a JSON object, as training writes results.json)"),
    "study a string": (_with(study="x"), "study: 'x' is a string (allowed: an object with overrides, as the study "
                                         "writes it)"),
    "jobs a string": (_with(**{"study.jobs": "abc", "device": KeyError}),
                      "study.jobs: 'abc' is a string (allowed: a whole number >= 1, or null)"),
    "jobs 0": (_with(**{"study.jobs": 0}), "study.jobs: 0 is not a whole number >= 1 (allowed: a whole number >= 1, "
                                          "or null)"),
    "overrides a number": (_with(**{"study.overrides": 5}),
                           "study.overrides: 5 is a number (allowed: a list of train.py settings, key=value)"),
    "an override a number": (_with(**{"study.overrides": ["a=1", 5]}),
                             "study.overrides[1]: 5 is a number (allowed: a train.py setting, key=value)"),
    "a leg a string": (_with(code_legs=["x"]),
                       "code_legs[0]: 'x' is a string (allowed: an object {commit, dirty, from_step})"),
    "from_step a string": (_with(code_legs=[{"from_step": "abc", "commit": None}]),
                           "code_legs[0].from_step: 'abc' is a string (allowed: a whole number >= 0, or null)"),
    "code a string": (_with(code="x"), "code: 'x' is a string (allowed: an object, or null)"),
    "commit an option": (_with(**{"code.commit": "--output=/tmp/x"}),
                         "code.commit: '--output=/tmp/x' is not a git commit (hex) (allowed: a git commit (hex), "
                         "or null)"),
    "cpu a list": (_with(cpu=[1]), "cpu: a list (allowed: an object, or null)"),
}


def _no_work(*a, **k):
    raise AssertionError("--verify started work on a record it should refuse")


@pytest.mark.parametrize("case", list(BAD_RESULTS))
def test_a_damaged_results_json_is_refused_before_any_work(case, tmp_path, tmpdir_here, capsys, monkeypatch):
    change, what = BAD_RESULTS[case]
    record = make_record(tmp_path / "rec", change(json.loads(json.dumps(RESULTS))))
    monkeypatch.setattr(verify_mod, "rerun_code", _no_work)  # the code export: never reached
    with pytest.raises(UserError) as e:
        verify(record, 20)
    code, err = one_line(capsys, e.value)
    assert (code, err) == (EXIT_USER_ERROR, f"error: {record}/results.json: {what}\n")
    assert list(tmpdir_here.iterdir()) == []


@pytest.mark.parametrize("metrics, what", [
    (METRICS.encode() + b"0,2,\xff,8.0\n", "metrics.csv:4: byte 0xff is not UTF-8 text (allowed: UTF-8 text, as "
                                           "training's CSV logger writes it)"),
    (METRICS.replace("8.25", "abc").encode(), "metrics.csv:3: train/loss: 'abc' is not a number (allowed: a number, "
                                              "or empty)"),
], ids=["not UTF-8", "a loss not a number"])
def test_a_damaged_metrics_csv_is_refused_at_its_line(metrics, what, tmp_path, tmpdir_here, capsys, monkeypatch):
    record = make_record(tmp_path / "rec", metrics=metrics)
    monkeypatch.setattr(verify_mod, "rerun_code", _no_work)
    with pytest.raises(UserError) as e:
        verify(record, 20)
    assert one_line(capsys, e.value) == (EXIT_USER_ERROR, f"error: {record}/{what}\n")
    assert list(tmpdir_here.iterdir()) == []


@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt(),
                                     UserError("abc1234", "a commit this clone does not have")],
                         ids=["an error", "Ctrl-C", "a refusal that names no file in it"])
def test_the_temporary_folder_is_removed_when_the_rerun_breaks_off(failure, tmp_path, tmpdir_here, monkeypatch):
    record = make_record(tmp_path / "rec")
    made = []

    def fail(res, steps, run_dir, *a, **k):  # after the folder exists (and the code is chosen)
        made.append(run_dir.parent)
        raise failure

    monkeypatch.setattr(verify_mod, "train_command", fail)
    with pytest.raises(type(failure)):
        verify(record, 20, say=lambda line: None)
    assert made and made[0].parent == tmpdir_here and not made[0].exists()
    assert list(tmpdir_here.iterdir()) == []


def _fake_rerun(returncode: int, metrics: str | None):
    """subprocess.run standing in for the rerun: the run folder it would write, and its exit status."""
    def run(cmd, **kwargs):
        run_dir = Path(next(a for a in cmd if a.startswith("hydra.run.dir=")).partition("=")[2])
        if metrics is not None:
            (run_dir / "csv").mkdir(parents=True)
            (run_dir / "csv" / "metrics.csv").write_text(metrics)
            (run_dir / "results.json").write_text(json.dumps({"status": "stopped"}))
        return subprocess.CompletedProcess(cmd, returncode)
    return run


@pytest.mark.parametrize("returncode, metrics, status, kept", [
    (0, METRICS, 0, False),                           # verified: gone
    (0, METRICS.replace("8.25", "8.5"), 1, True),     # differs: kept, named
    (1, None, "failed", True),                        # the rerun failed: kept, its log named
], ids=["equal", "differs", "failed"])
def test_the_folder_is_kept_only_where_a_line_names_it(returncode, metrics, status, kept, tmp_path, tmpdir_here,
                                                       monkeypatch):
    record = make_record(tmp_path / "rec")
    monkeypatch.setattr(verify_mod.subprocess, "run", _fake_rerun(returncode, metrics))
    lines = []
    if status == "failed":
        with pytest.raises(UserError, match=r"the rerun failed \(exit 1\): no output \(log: "):
            verify(record, 20, say=lines.append)
    else:
        assert verify(record, 20, say=lines.append) == status
    left = list(tmpdir_here.iterdir())
    assert len(left) == kept
    assert not kept or status == "failed" or f"kept: {left[0]}" in lines


@pytest.mark.parametrize("flag", ["--out", "--runs"])
@pytest.mark.parametrize("mode", [[], ["--status"], ["--report-only"], ["--verify", "pre_ln-s1"], ["--list"]],
                         ids=["run", "status", "report-only", "verify", "list"])
def test_a_file_as_out_or_runs_is_refused_in_every_mode(flag, mode, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for path, msg in ((afile, f"{afile} is a file, not a folder (allowed: a folder, or a path to make one)"),
                      (afile / "sub", f"{afile / 'sub'}: {afile} is a file, not a folder (allowed: a folder, or a path to make one)"),
                      ("", f"an empty path (allowed: a folder, or no {flag} for the default)")):
        with pytest.raises(UserError) as e:
            parse(["deep_bleu", *mode, flag, str(path)])
        assert one_line(capsys, e.value) == (EXIT_USER_ERROR, f"error: {flag}: {msg}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


STUDY = """title: t
paper: p
question: q
seeds: [1]
common: []
arms:
  pre: {overrides: [norm=prenorm]}
claims:
  - {id: trains, claim: pre trains, source: s, paper: '-', better: pre, kind: trains}
"""


@pytest.mark.parametrize("setting", [["study.budget="], ["budget="], ["--budget", ""], ["--budget="]])
def test_an_empty_budget_is_refused_not_taken_for_full(setting, tmp_path, capsys):
    spec = tmp_path / "t.yaml"
    spec.write_text(STUDY)
    args = parse([str(spec), *setting, "--status"])
    with pytest.raises(UserError) as e:
        load_study(args.name, args.budget)
    assert one_line(capsys, e.value) == (EXIT_USER_ERROR, "error: study.budget: '' is not a budget of t "
                                                          "(allowed: full, smoke)\n")


@pytest.mark.integration
def test_the_console_script_refuses_in_one_line_and_leaves_nothing(tmp_path):
    """As a user runs it: one line on stderr, exit 2, no traceback, no folder made, no temp folder."""
    afile = tmp_path / "afile"
    afile.write_text("")
    record = make_record(tmp_path / "rec", _with(code="x")(json.loads(json.dumps(RESULTS))))
    tmp, out = tmp_path / "tmp", tmp_path / "x"
    tmp.mkdir()
    cases = [(["--verify", record], f"error: {record}/results.json: code: 'x' is a string (allowed: an object, "
                                    "or null)"),
             (["--status", "--out", afile], f"error: --out: {afile} is a file, not a folder (allowed: a folder, or a path to make one)"),
             (["--report-only", "--runs", afile], f"error: --runs: {afile} is a file, not a folder (allowed: a folder, or a path to make one)"),
             (["study.budget=", "--status"], "error: study.budget: '' is not a budget of deep_bleu (allowed: ")]
    for args, msg in cases:
        r = subprocess.run([sys.executable, "-m", "normlab.commands.study", "deep_bleu", *map(str, args),
                            *(["--out", out / "deep_bleu"] if "--out" not in args else []),
                            *(["--runs", out / "runs"] if "--runs" not in args else [])],
                           cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "TMPDIR": str(tmp)})
        assert r.returncode == EXIT_USER_ERROR and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(msg) and len(r.stderr.splitlines()) == 1 and r.stdout == "", r.stderr
    assert not out.exists() and list(tmp.iterdir()) == []
