"""The runs command on hand-written run folders (no training): every row's values, the filter, the
sort, the JSON, damaged records, a live holder's lock, the empty and the bad-flag messages."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from normlab import cli, errors
from normlab.commands import runs
from normlab.commands.common import main_guard

from conftest import ROOT


def make_run(root: Path, name: str, results: dict | None = None, record: dict | None = None,
             config: dict | None = None, created: str | None = None) -> Path:
    """A run folder as train.py leaves it: results.json, run.json, .hydra/config.yaml (each optional)."""
    d = root / name
    d.mkdir(parents=True)
    if results is not None:
        (d / "results.json").write_text(json.dumps(results))
    if record is not None or created is not None:
        (d / "run.json").write_text(json.dumps({"identity_hash": "0", "created": created, **(record or {})}))
    if config is not None:
        (d / ".hydra").mkdir()
        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    return d


def finished(status="completed", **extra) -> dict:
    return {"status": status, "steps": 4000, "planned_steps": 4000, "seed": 1, "valid_bleu": 12.345,
            "test_bleu": 11.2, "wall_s": 3924.3, "group": "default",
            "labels": {"data": "bible_de_en", "norm": "pre_ln", "init": "xavier", "arm": "pre_ln"}, **extra}


def listing(capsys, *argv) -> tuple[int, str, str]:
    code = main_guard(runs.main, [str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows_of(capsys, *argv) -> list[dict]:
    code, out, _ = listing(capsys, *argv, "--json")
    assert code == 0
    return json.loads(out)


@pytest.fixture()
def sweep(tmp_path) -> Path:
    """Four runs of one sweep, started in the order a (oldest), d, b, c."""
    root = tmp_path / "multirun" / "deep-1a2b3c4d"
    make_run(root, "a", finished(), created="2026-01-01 10:00:00")
    make_run(root, "b", finished("diverged", test_bleu=None, valid_bleu=None, steps=40, seed=2,
                                 wall_s=42.0), created="2026-01-03 09:00:00")
    make_run(root, "c", finished(test_bleu=27.5, seed=3, wall_s=75.0), created="2026-01-03 09:00:01")
    # not finished: no results.json; run.json's identity is post-LN with Admin's init (Liu et al. 2020)
    config = {"seed": 5, "trainer": {"max_steps": 2000}, "data": {"max_positions": "${model.max_positions}"}}
    d = make_run(root, "d", None, config=config,
                 record={"identity": {"data": {"name": "iwslt14_de_en"}, "norm": {"placement": "post"},
                                      "init": {"name": "admin"}, "model": {}, "seed": 5}},
                 created="2026-01-02 00:00:00")
    (d / "checkpoints").mkdir()
    for name in ("full-step200.ckpt", "full-step1400.ckpt", "step1600.ckpt", "best-step1600.ckpt"):
        (d / "checkpoints" / name).write_bytes(b"")
    return root


def test_each_row_holds_the_runs_values(sweep, capsys):
    rows = {r["run"]: r for r in rows_of(capsys, sweep)}
    a, b, c, d = (rows[str(sweep / n)] for n in "abcd")
    assert {k: a[k] for k in ("status", "steps", "planned_steps", "corpus", "norm", "arm", "study", "seed",
                              "valid_bleu", "test_bleu", "wall_s", "started", "problem")} == {
        "status": "completed", "steps": 4000, "planned_steps": 4000, "corpus": "bible_de_en", "norm": "pre_ln",
        "arm": "pre_ln", "study": None, "seed": 1, "valid_bleu": 12.345, "test_bleu": 11.2, "wall_s": 3924.3,
        "started": "2026-01-01 10:00:00", "problem": None}
    assert a["path"] == str((sweep / "a").resolve())
    assert (b["status"], b["steps"], b["test_bleu"], b["seed"]) == ("diverged", 40, None, 2)
    # no record: labels from run.json's identity (post-LN + Admin init is the arm "admin"), the
    # config's seed and max_steps, and the step a rerun continues from (the newest full checkpoint)
    assert {k: d[k] for k in ("status", "steps", "planned_steps", "corpus", "norm", "arm", "seed", "test_bleu")} == {
        "status": "no record", "steps": 1400, "planned_steps": 2000, "corpus": "iwslt14_de_en", "norm": "post_ln",
        "arm": "admin", "seed": 5, "test_bleu": None}


def test_the_table_shows_the_values(sweep, capsys):
    code, out, err = listing(capsys, sweep)
    assert code == 0
    head, *lines = out.splitlines()
    assert head.split() == ["run", "status", "steps", "corpus", "norm", "arm", "study", "seed", "valid", "BLEU",
                            "test", "BLEU", "wall", "started"]
    assert lines[0].split() == [str(sweep / "a"), "completed", "4000/4000", "bible_de_en", "pre_ln", "pre_ln", "-",
                                "1", "12.35", "11.20", "1h05m", "2026-01-01", "10:00:00"]
    assert lines[1].split()[:3] == [str(sweep / "d"), "no", "record"]
    assert lines[2].split()[-5:-2] == ["-", "-", "42s"] and lines[3].split()[-3] == "1m15s"
    assert [line.index("completed") for line in lines if "completed" in line] == [head.index("status")] * 2  # aligned
    assert err == "4 runs: 2 completed, 1 diverged, 1 no record\n"


def test_sorted_by_start_time_or_by_a_column(sweep, capsys):
    names = lambda rows: [Path(r["run"]).name for r in rows]  # noqa: E731
    assert names(rows_of(capsys, sweep)) == ["a", "d", "b", "c"]  # newest last
    # absent values first (so the best score is the last line), equal values by start time
    assert names(rows_of(capsys, sweep, "--sort", "test_bleu")) == ["d", "b", "a", "c"]
    assert names(rows_of(capsys, sweep, "--sort", "seed")) == ["a", "b", "c", "d"]
    assert names(rows_of(capsys, sweep, "--sort", "status")) == ["a", "c", "b", "d"]


def test_the_status_filter(sweep, capsys):
    assert [Path(r["run"]).name for r in rows_of(capsys, sweep, "--status", "completed")] == ["a", "c"]
    assert [Path(r["run"]).name for r in rows_of(capsys, sweep, "--status", "diverged,no-record")] == ["d", "b"]
    code, out, err = listing(capsys, sweep, "--status", "stalled")
    assert (code, out) == (0, "")
    assert err == "no runs with status stalled (4 runs: 2 completed, 1 diverged, 1 no record)\n"
    code, _, err = listing(capsys, sweep, "--status", "finished")
    assert code == 2 and err.startswith("error: --status=finished: no such status finished (allowed: training, ")
    assert len(err.splitlines()) == 1 and "no record, damaged)" in err


def test_labels_of_a_study(tmp_path, capsys):
    root = tmp_path / "runs"
    # started by a study with labels.study / labels.arm (the arm a learning rate of one scheme)
    make_run(root, "given", finished(labels={"data": "bible_de_en", "norm": "post_ln", "arm": "post_ln_lr2e-3",
                                             "study": "twt_lowres", "scheme": "post_ln"}),
             config={"labels": {"study": "twt_lowres", "arm": "post_ln_lr2e-3", "budget": None}})
    make_run(root, "record", finished(study={"name": "deep_bleu", "arm": "admin", "seed": 1}))  # a study's record
    make_run(root, "grouped", finished(group="study-stall_calibration"))  # a study's run before labels
    make_run(root, "plain", finished(), config={"labels": {"study": None, "arm": None}})
    # a study run's first leg, before its record: the config's group names the study
    make_run(root, "starting", None, config={"group": "study-deep_bleu", "norm": {"placement": "pre"}})
    rows = {Path(r["run"]).name: (r["arm"], r["study"]) for r in rows_of(capsys, root)}
    assert rows == {"given": ("post_ln_lr2e-3", "twt_lowres"), "record": ("admin", "deep_bleu"),
                    "grouped": ("pre_ln", "stall_calibration"), "plain": ("pre_ln", None),
                    "starting": ("pre_ln", "deep_bleu")}


def test_a_record_from_before_the_corpus_label(tmp_path, capsys):
    old = finished(labels={"norm": "pre_ln", "init": "xavier", "arm": "pre_ln"})  # no `data` label yet
    ident = {"data": {"name": "iwslt14_de_en"}, "norm": {"placement": "post"}, "init": {"name": "admin"}, "model": {}}
    make_run(tmp_path, "old", old, record={"identity": ident})
    (row,) = rows_of(capsys, tmp_path)
    # the corpus from run.json's identity; the labels the record holds are kept (not recomputed)
    assert (row["corpus"], row["norm"], row["arm"]) == ("iwslt14_de_en", "pre_ln", "pre_ln")


def test_damaged_records_are_rows(tmp_path, capsys):
    root = tmp_path / "runs"
    cut = json.dumps(finished())[:60]
    make_run(root, "cut", None, created="2026-01-01 00:00:01")
    (root / "cut" / "results.json").write_text(cut)
    make_run(root, "list", None, created="2026-01-01 00:00:02")
    (root / "list" / "results.json").write_text("[1, 2]")
    make_run(root, "dir", None, created="2026-01-01 00:00:03")
    (root / "dir" / "results.json").mkdir()  # cannot be read as a file
    make_run(root, "steps", finished(steps="many"), created="2026-01-01 00:00:04")
    make_run(root, "record", finished())
    (root / "record" / "run.json").write_text('{"created": ')
    make_run(root, "config", finished(), config={})
    (root / "config" / ".hydra" / "config.yaml").write_text("seed: [1\n")
    rows = {Path(r["run"]).name: r for r in rows_of(capsys, root)}
    assert {n: r["status"] for n, r in rows.items()} == {
        "cut": f"damaged: results.json: not JSON (cut off at byte {len(cut)}?)",
        "list": "damaged: results.json: a JSON list, not a JSON object",
        "dir": "damaged: results.json: unreadable (Is a directory)",
        "steps": "damaged: results.json: steps 'many' is not a number",
        "record": "damaged: run.json: not JSON (cut off at byte 12?)",
        "config": "damaged: .hydra/config.yaml: not YAML (line 2)"}
    # the readable files still fill the row; the damaged results.json is left as it is
    assert (rows["record"]["test_bleu"], rows["config"]["seed"], rows["steps"]["test_bleu"]) == (11.2, 1, None)
    assert (root / "cut" / "results.json").read_text() == cut
    assert [Path(r["run"]).name for r in rows_of(capsys, root, "--status", "damaged")] == list(rows)
    code, out, err = listing(capsys, root)
    assert code == 0 and "damaged: results.json: a JSON list" in out
    assert err == "6 runs: 6 damaged\n"


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_run_held_by_a_live_process_is_training(tmp_path, capsys):
    root = tmp_path / "runs"
    live = make_run(root, "live", finished("preempted", steps=300), created="2026-01-01 00:00:00")
    (live / "checkpoints").mkdir()
    (live / "checkpoints" / "full-step600.ckpt").write_bytes(b"")  # trained further since its last leg
    # a lock file a killed run left behind: no process holds it (flock is released by the kernel)
    left = make_run(root, "left", finished("preempted", steps=300), created="2026-01-01 00:00:01")
    (left / ".lock").write_text("process 1 on elsewhere since 2026-01-01 00:00:00")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(live / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        rows = {Path(r["run"]).name: (r["status"], r["steps"]) for r in rows_of(capsys, root)}
    finally:
        holder.kill()
        holder.wait()
    assert rows == {"live": ("training", 600), "left": ("preempted", 300)}
    assert [r["status"] for r in rows_of(capsys, root)] == ["preempted", "preempted"]  # the holder ended


def test_folders_searched(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_run(Path("outputs"), "single", finished(), created="2026-01-01 00:00:00")
    make_run(Path("multirun/sweep-1a2b/0"), "", None, config={"seed": 1})  # a job before its run.json: started now
    make_run(Path("studies/runs"), "study_run", finished(), created="2026-01-02 00:00:00")
    make_run(Path("elsewhere"), "other", finished())
    # inside a run folder (an evaluation's output) and a hidden folder (a record being written): no rows
    make_run(Path("outputs/single"), "eval", finished())
    make_run(Path("studies/runs"), ".record.tmp", finished())
    assert [r["run"] for r in rows_of(capsys)] == ["outputs/single", "studies/runs/study_run", "multirun/sweep-1a2b/0"]
    assert [r["run"] for r in rows_of(capsys, "elsewhere/other")] == ["elsewhere/other"]  # a run folder itself


def test_nothing_to_list(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert listing(capsys) == (0, "", "no runs below here (none of outputs, multirun, studies/runs exists): a run "
                                      "folder holds run.json, results.json or .hydra/config.yaml\n")
    (tmp_path / "empty").mkdir()
    assert listing(capsys, "empty", "--json") == (0, "[]\n", "no runs below empty: a run folder holds run.json, "
                                                               "results.json or .hydra/config.yaml\n")


def test_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    cases = {("--sort", "bleu"): "error: --sort=bleu: no such column (allowed: run, status, steps, corpus, norm, "
                                 "arm, study, seed, valid_bleu, test_bleu, wall_s, started)\n",
             (tmp_path / "nope",): f"error: {tmp_path / 'nope'}: no such folder\n",
             (tmp_path / "file",): f"error: {tmp_path / 'file'}: not a folder\n"}
    for argv, message in cases.items():
        assert listing(capsys, *argv) == (2, "", message)
    code, out, err = listing(capsys, "--colour")
    assert code == 2 and err == ("error: python -m normlab.commands.runs: unrecognized arguments: --colour "
                                 "(see python -m normlab.commands.runs --help)\n")


@pytest.mark.integration
def test_module_and_console_script(sweep, capsys, monkeypatch):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    ok = subprocess.run([sys.executable, "-m", "normlab.commands.runs", str(sweep), "--status", "diverged"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0 and ok.stdout.splitlines()[1].split()[:2] == [str(sweep / "b"), "diverged"]
    bad = subprocess.run([sys.executable, "-m", "normlab.commands.runs", "--sort", "x"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --sort=x: no such column") and not bad.stdout
    assert len(bad.stderr.splitlines()) == 1
    monkeypatch.setattr(errors, "_console_script", None)  # cli.runs sets it: restored after the test
    monkeypatch.setattr(sys, "argv", ["normlab-runs", str(sweep), "--json"])
    with pytest.raises(SystemExit) as end:
        cli.runs()
    assert end.value.code == 0 and len(json.loads(capsys.readouterr().out)) == 4
    monkeypatch.setattr(sys, "argv", ["normlab-runs", "--colour"])
    with pytest.raises(SystemExit) as end:
        cli.runs()
    assert end.value.code == 2 and capsys.readouterr().err == ("error: normlab-runs: unrecognized arguments: "
                                                               "--colour (see normlab-runs --help)\n")


def test_the_listing_takes_its_names_from_their_owners(tmp_path):
    """Where runs go and what their files are called come from the modules that decide them (a
    change there cannot leave the listing looking elsewhere): the folders are Hydra's run and sweep
    folders (conf/hydra/default.yaml) and normlab-study's run pool; a checkpoint step is read by the
    function the training callback uses; `started` parses run.json's `created` as written."""
    import time

    from normlab import run_folder
    from normlab.callbacks import full_checkpoint
    from normlab.commands.study import SHARED_RUNS

    hydra = yaml.safe_load((ROOT / "conf" / "hydra" / "default.yaml").read_text())
    assert hydra["run"]["dir"] == f"${{nl.run_dir:{run_folder.OUTPUTS}}}"
    assert hydra["sweep"]["dir"].split("/")[0] == run_folder.MULTIRUN
    assert runs.DEFAULT_FOLDERS == ("outputs", "multirun", "studies/runs") == (
        run_folder.OUTPUTS, run_folder.MULTIRUN, str(SHARED_RUNS))
    assert full_checkpoint.full_checkpoints is run_folder.full_checkpoints  # what the callback writes and prunes by
    for name in ("full-step12.ckpt", "full-step3.ckpt", "full-stepx.ckpt", "step40.ckpt"):
        (tmp_path / "checkpoints").mkdir(exist_ok=True)
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    assert runs.checkpoint_step(tmp_path) == 12
    created = time.strftime(run_folder.CREATED_FORMAT)
    assert runs._started(tmp_path, {"created": created}) == created
    assert runs._study_of_group("study-twt_lowres") == "twt_lowres" and runs._study_of_group("multirun-1a2b3c") is None
