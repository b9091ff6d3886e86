"""The report command on hand-written run folders: every cell of the table, by value."""
import csv
import json
import shutil
import os
import time
from pathlib import Path

import pytest
import yaml

from normlab.commands import report

SIG = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.5.1"


def job(root: Path, name: str, arm: str, depth: int, seed: int, status: str | None, bleu: float | None = None,
        **extra) -> Path:
    """A run folder as train.py leaves it: .hydra/{config,hydra,overrides}.yaml (+ results.json)."""
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    norm = {"admin": "postnorm", "post_ln": "postnorm", "pre_ln": "prenorm"}[arm]
    config = {"seed": seed, "name": "${hydra:runtime.choices.norm}-s${seed}",  # unresolvable outside Hydra
              "model": {"encoder_layers": depth, "decoder_layers": "${model.encoder_layers}", "d_model": 64},
              "norm": {"placement": "post" if norm == "postnorm" else "pre"},
              "optim": {"lr": 0.003, "warmup": 100}, "data": {"train_src": f"/data/{name}.de", "seed": "${seed}"}}
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    choices = {"norm": norm, "init": "admin" if arm == "admin" else "xavier", "arm": arm, "hydra/sweeper": "basic"}
    (d / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"+arm={arm}", f"model.encoder_layers={depth}",
                                                                 f"seed={seed}"]))
    if status is not None:
        res = {"status": status, "seed": seed, "bleu_signature": SIG, **extra}
        if bleu is not None:
            res["test_bleu"] = bleu
        (d / "results.json").write_text(json.dumps(res))
    return d


@pytest.fixture()
def sweep(tmp_path) -> Path:
    root = tmp_path / "multirun"
    # post_ln: fine at depth 2 (two seeds), at depth 6 one seed diverged and one completed
    job(root, "0", "post_ln", 2, 1, "completed", 10.0)
    job(root, "1", "post_ln", 2, 2, "completed", 12.0)
    job(root, "2", "post_ln", 6, 1, "diverged", diverged_step=40, divergence_reason="non-finite loss (nan)")
    job(root, "3", "post_ln", 6, 2, "completed", 9.0)
    # pre_ln: depth 2 one seed only; depth 6 failed (results.json) + a job folder without results.json
    job(root, "4", "pre_ln", 2, 1, "completed", 11.5)
    job(root, "5", "pre_ln", 6, 1, "failed", error="FileNotFoundError: /nope.de")
    stale = job(root, "6", "pre_ln", 6, 2, None)
    for f in [*stale.rglob("*")]:  # written an hour ago: crashed, not running
        os.utime(f, (time.time() - 3600, time.time() - 3600))
    # admin: depth 6 both diverged; depth 2 missing
    job(root, "7", "admin", 6, 1, "diverged", diverged_step=3)
    job(root, "8", "admin", 6, 2, "diverged", diverged_step=5)
    return root


def cells(table) -> dict:
    return {(rv[0], cv[0]): c["text"] for (rv, cv), c in table["cells"].items()}


def test_table_cell_by_cell(sweep):
    runs = report.find_runs([str(sweep)])
    assert len(runs) == 9
    table = report.build_table(runs, ["arm"], ["model.encoder_layers"], "test_bleu")
    assert table["row_values"] == [("admin",), ("post_ln",), ("pre_ln",)]
    assert table["col_values"] == [(2,), (6,)]
    assert cells(table) == {
        ("post_ln", 2): "11.00 ± 1.41",                # mean ± sample std of 10 and 12
        ("post_ln", 6): "9.00 (1/2 diverged)",        # mean over the completed run only
        ("pre_ln", 2): "11.50",                        # one seed: no ±
        ("pre_ln", 6): "failed 2/2",                   # failed status + a job without results.json
        ("admin", 2): "missing",
        ("admin", 6): "diverged 2/2",
    }
    c = table["cells"][(("post_ln",), (6,))]
    assert (c["n"], c["completed"], c["diverged"], c["failed"]) == (2, 1, 1, 0)


def test_expect_seeds_and_mixed_failures(sweep):
    job(sweep, "9", "pre_ln", 6, 3, "diverged", diverged_step=1)
    table = report.build_table(report.find_runs([str(sweep)]), ["arm"], ["model.encoder_layers"], "test_bleu",
                               expect_seeds=3)
    got = cells(table)
    assert got[("post_ln", 2)] == "11.00 ± 1.41 (1/3 missing)"
    assert got[("pre_ln", 2)] == "11.50 (2/3 missing)"
    assert got[("pre_ln", 6)] == "diverged 1/3, failed 2/3"
    assert got[("admin", 2)] == "missing"


def test_a_job_still_writing_is_running_not_failed(sweep):
    job(sweep, "10", "admin", 2, 1, None)
    table = report.build_table(report.find_runs([str(sweep)]), ["arm"], ["model.encoder_layers"], "test_bleu")
    assert cells(table)[("admin", 2)] == "running 1/1"


def test_rows_from_choices_and_config_keys(sweep):
    runs = report.find_runs([str(sweep)])
    table = report.build_table(runs, ["norm", "init"], ["norm.placement"], "test_bleu")
    assert [rv for rv in table["row_values"]] == [("postnorm", "admin"), ("postnorm", "xavier"), ("prenorm", "xavier")]
    got = {(rv, cv[0]): c["text"] for (rv, cv), c in table["cells"].items()}
    assert got[(("postnorm", "xavier"), "post")] == "10.33 ± 1.53 (1/4 diverged)"
    assert got[(("postnorm", "xavier"), "pre")] == "missing"
    assert report.differing_settings(runs) == {
        "choice:arm": ["admin", "post_ln", "pre_ln"], "choice:init": ["admin", "xavier"],
        "choice:norm": ["postnorm", "prenorm"], "model.decoder_layers": [2, 6], "model.encoder_layers": [2, 6],
        "norm.placement": ["post", "pre"]}


def test_command_writes_outputs_and_refuses_to_overwrite(sweep, tmp_path, capsys):
    # training curves for two runs and a prune table for one
    for name, losses in (("0", [5.0, 4.0, 3.5]), ("3", [5.0, 4.5, 4.2])):
        (sweep / name / "csv").mkdir()
        rows = ["epoch,step,train/loss"] + [f"0,{10 * (i + 1)},{v}" for i, v in enumerate(losses)]
        (sweep / name / "csv" / "metrics.csv").write_text("\n".join(rows) + "\n")
    (sweep / "0" / "prune").mkdir()
    (sweep / "0" / "prune" / "prune.json").write_text(json.dumps({"bleu_signature": SIG, "rows": [
        {"strategy": "full", "kept": 2, "test_bleu": 10.0}, {"strategy": "every_other", "kept": 1, "test_bleu": 4.0}]}))
    out = tmp_path / "rep"
    argv = [str(sweep), "--rows", "arm", "--cols", "model.encoder_layers", "--out", str(out)]
    assert report.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| arm \\ model.encoder_layers | 2 | 6 |" in printed and "diverged 2/2" in printed
    md = (out / "report.md").read_text()
    assert SIG in md and "9 runs" in md and "FileNotFoundError: /nope.de" in md and "no results.json (the job crashed" in md
    assert "| arm | strategy | kept 1 | kept 2 |" in md
    assert "| post_ln | full |  | 10.00 |" in md and "| post_ln | every_other | 4.00 |  |" in md
    for f in ("report.csv", "runs.csv", "report.json", "curves.png", "test_bleu_vs_model_encoder_layers.png",
              "prune_depth.png"):
        assert (out / f).is_file(), f
    rows = {(r["arm"], r["model.encoder_layers"]): r for r in csv.DictReader(open(out / "report.csv"))}
    assert rows[("post_ln", "6")]["diverged"] == "1" and rows[("post_ln", "6")]["mean"] == "9.0"
    assert json.loads((out / "report.json").read_text())["signatures"] == [SIG]
    with pytest.raises(report.CommandError, match="--force"):
        report.main(argv)
    assert report.main(argv + ["--force", "--metric", "valid_loss", "--no-plots"]) == 0
    assert "n/a" in (out / "report.md").read_text()  # completed runs without valid_loss


def test_no_metric_vs_column_plot_from_one_column_value(sweep, tmp_path):
    out = tmp_path / "one"
    argv = [str(sweep), "--rows", "arm", "--cols", "model.encoder_layers", "--out", str(out)]
    for run in sweep.glob("*/"):  # keep the depth-6 runs only: one column value
        cfg = run / ".hydra" / "config.yaml"
        if cfg.is_file() and "encoder_layers: 2" in cfg.read_text():
            shutil.rmtree(run)
    assert report.main(argv) == 0
    assert (out / "report.csv").is_file() and not (out / "test_bleu_vs_model_encoder_layers.png").exists()
    assert "test_bleu_vs_" not in (out / "report.md").read_text()  # nor a link to one


def test_a_stopped_or_preempted_run_is_shown_as_such_not_failed(tmp_path):
    """One status vocabulary: a run stopped by max_time or preempted by a signal is what it is in the
    report (the same command continues it), not 'failed'."""
    import json as _json

    from normlab.commands import report as rep
    from normlab.commands.report_runs import find_runs

    for i, status in enumerate(("stopped", "preempted", "completed")):
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "results.json").write_text(_json.dumps({"status": status, "seed": i, "steps": 5, "planned_steps": 10,
                                                     "valid_loss": 3.0, "labels": {"norm": "pre_ln"}}))
    runs = find_runs([str(tmp_path)])
    assert sorted(r.status for r in runs) == ["completed", "preempted", "stopped"]
    cell = rep.cell_stats(runs, "valid_loss")
    assert "stopped" in cell["text"] and "preempted" in cell["text"] and "failed" not in cell["text"]


def lr_arms(root: Path) -> Path:
    """A study's runs: post-LN at three learning rates (arms post_ln_lr<lr>), seeds 1 and 2 (one seed of
    the last), one of them trained on a GPU; each run's config carries its study arm (labels), as
    normlab-study starts them."""
    for i, (lr, seed) in enumerate([(0.001, 1), (0.001, 2), (0.002, 1), (0.002, 2), (0.003, 1)]):
        arm = f"post_ln_lr{lr:g}"
        d = job(root, str(i), "post_ln", 2, seed, "completed", 10.0 + i,
                labels={"norm": "post_ln", "arm": arm, "scheme": "post_ln", "study": "s"})
        cfg = yaml.safe_load((d / ".hydra" / "config.yaml").read_text())
        cfg["optim"]["lr"] = lr
        cfg["labels"] = {"study": "s", "arm": arm, "budget": "full", "debug": None}
        cfg["trainer"] = {"accelerator": "gpu" if i == 4 else "cpu"}  # where it ran: not what it learned
        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root


def test_a_cell_that_pools_different_configs_says_so(tmp_path, capsys):
    """The report's rows by the scheme (norm) pool three learning rates into one cell: one warning line
    names the key (not the seed, the labels, where a run trained, its paths or its name); the study's
    arms as rows (results.json labels.arm) or the key as a column keep them apart, without a warning."""
    root = lr_arms(tmp_path / "runs")
    out = tmp_path / "rep"
    assert report.main([str(root), "--rows", "norm", "--cols", "model.encoder_layers", "--out", str(out)]) == 0
    warning = ("warning: 1 of 1 cells pool runs whose configs differ in optim.lr (cell post_ln × 2: optim.lr: "
               "0.001, 0.002, 0.003): add the keys to --rows or --cols to separate them")
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [warning]
    assert f"**{warning}**" in (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["cells"][0]["pooled"] == {"optim.lr": [0.001, 0.002, 0.003]}
    for rows, cols in (("arm", "model.encoder_layers"), ("norm", "optim.lr"), ("labels.arm", "seed")):
        assert report.main([str(root), "--rows", rows, "--cols", cols, "--out", str(out), "--force"]) == 0
        assert "warning" not in capsys.readouterr().err, (rows, cols)
    table = report.build_table(report.find_runs([str(root)]), ["arm"], ["model.encoder_layers"], "test_bleu")
    assert {rv[0]: c["text"] for (rv, _), c in table["cells"].items()} == {
        "post_ln_lr0.001": "10.50 ± 0.71", "post_ln_lr0.002": "12.50 ± 0.71", "post_ln_lr0.003": "14.00"}


def test_seeds_of_one_config_pool_without_a_warning(sweep, tmp_path, capsys):
    assert report.main([str(sweep), "--rows", "arm", "--cols", "model.encoder_layers", "--out", str(tmp_path / "r")]) == 0
    assert "warning" not in capsys.readouterr().err
    runs = report.find_runs([str(sweep)])  # post-LN's two depths in one column: the depth is named
    table = report.build_table(runs, ["arm"], ["norm.placement"], "test_bleu")
    assert table["cells"][(("post_ln",), ("post",))]["pooled"] == {"model.decoder_layers": [2, 6],
                                                                   "model.encoder_layers": [2, 6]}


@pytest.mark.parametrize("damage, what", [
    ('[{"status": "completed", "test_bleu": 30.0}]', "a JSON list, not a JSON object"),
    ('{"status": "completed", "test_bl', "not JSON (cut off at byte 32?)"),
    ('"completed"', "a JSON string, not a JSON object"),
])
def test_a_damaged_results_json_is_one_line_and_the_run_is_missing(damage, what, sweep, tmp_path, capsys):
    """results.json that is not an object (a list: `report` crashed on `.get` with a traceback) or is
    cut off (it counted as a failed run): named in one line, the run left out as missing, the file
    as it was; the rest of the report is unchanged."""
    from normlab.commands.common import main_guard

    bad = sweep / "8" / "results.json"  # admin, depth 6, seed 2
    bad.write_text(damage)
    out = tmp_path / "r"
    assert main_guard(report.main, [str(sweep), "--rows", "arm", "--cols", "model.encoder_layers", "--out", str(out),
                                    "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith(("warning:", "error:"))] == [
        f"warning: {bad}: {what}: the run is left out of the report (as missing)"] and "Traceback" not in err
    assert bad.read_text() == damage
    table = report.build_table(report.find_runs([str(sweep)]), ["arm"], ["model.encoder_layers"], "test_bleu",
                               expect_seeds=2)
    assert cells(table)[("admin", 6)] == "diverged 1/1, 1/2 missing"  # was: a traceback, or a failed run
    assert cells(table)[("post_ln", 2)] == "11.00 ± 1.41"
