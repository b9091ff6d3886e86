"""A study's runs carry their study and arm (issue 37): in their config (`labels`, not part of the
identity, so the committed records keep their names), results.json, W&B tags and group (a smoke
study's apart from the real one's); an offline W&B run says where it is and how to sync it; a study
logs its verdict table to W&B beside its runs."""
import json
from pathlib import Path

import pytest

from normlab import identity
from normlab.run_identity import identify
from normlab.study.plan import compose, make_job, plan
from normlab.study.runner import Sweep
from normlab.study.spec import load_study
from normlab.train import run

from conftest import compose_cfg, tiny_overrides, wandb_records
from study_files import claim, record, write_study_file

ROOT = Path(__file__).resolve().parents[1]


def test_a_study_plans_its_runs_with_their_labels_and_the_records_keep_their_names(tmp_path):
    """twt_lowres_2k: each planned run is composed with labels.study / arm / budget, and is the run its
    committed record names (the same identity hash, though the study was renamed from twt_lowres since:
    the labels are not identity); its W&B group is the study's, and the smoke budget's is another."""
    study = load_study("twt_lowres_2k")
    jobs = plan(study, tmp_path / "runs", tmp_path / "out")
    recorded = {p.parent.name: json.loads(p.read_text())
                for p in (ROOT / "experiments" / "twt_lowres_2k" / "runs").glob("*/results.json")}
    assert len(recorded) == len(jobs) == 8
    for job in jobs:
        rec = recorded[f"{job.arm.name}-s{job.seed}"]
        assert job.labels == ("labels.study='twt_lowres_2k'", f"labels.arm='{job.arm.name}'", "labels.budget='full'")
        assert job.identity_hash == rec["identity_hash"] and job.run_name.endswith(rec["name"])
        assert not [o for o in job.overrides if o.startswith("labels.")]  # the record's overrides: what it ran
    job = next(j for j in jobs if j.arm.name == "post_ln_lr2e-3")
    cfg = compose([*job.overrides, *job.labels])
    assert identify(cfg).group == "study-twt_lowres_2k" and recorded["post_ln_lr2e-3-s1"]["group"] == "study-twt_lowres"
    assert identity.labels(cfg)["arm"] == "post_ln_lr2e-3" and identity.labels(cfg)["scheme"] == "post_ln"
    sweep = Sweep(study, jobs, tmp_path / "runs")
    command = sweep._train_command(job)
    sweep.log_file.close()
    assert [*job.labels] == command[-len(job.labels) - 1:-1] and not [a for a in command if a.startswith("group=")]
    smoke = plan(load_study("twt_lowres_2k", "smoke"), tmp_path / "smoke", tmp_path / "smoke_out")[0]
    assert identify(compose([*smoke.overrides, *smoke.labels])).group == "study-twt_lowres_2k-smoke"
    drophead = load_study("drophead")  # an arm named `none`: its label is that text
    arm = drophead.arms["none"]
    none = make_job(drophead, arm, 1, drophead.arm_overrides(arm, 1), tmp_path / "runs", tmp_path / "rec")
    assert identity.labels(compose([*none.overrides, *none.labels]))["arm"] == "none"


def run_records(run_dir: Path) -> tuple[dict, list[str], str]:
    """(config, tags, group) of the run's offline W&B run file."""
    (wfile,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    config, tags, group = {}, [], None
    for rec in wandb_records(wfile):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            tags, group = list(rec.run.tags), rec.run.run_group
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    return config, tags, group


@pytest.mark.integration
def test_a_study_run_carries_its_labels_to_results_and_wandb(small_corpus, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "offline")
    labels = ["labels.study=twt_lowres", "labels.arm=post_ln_lr2e-3", "labels.budget=smoke"]
    over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache")
    cfg = compose_cfg([*over, "logger=[wandb,csv]", "norm=postnorm", "trainer.max_steps=2",
                       "trainer.val_check_interval=2", "eval.test=false", *labels])
    with caplog.at_level("INFO", logger="normlab"):
        results = run(cfg)
    assert results["group"] == "study-twt_lowres-smoke"
    assert {k: results["labels"][k] for k in ("study", "arm", "budget", "scheme", "norm")} == {
        "study": "twt_lowres", "arm": "post_ln_lr2e-3", "budget": "smoke", "scheme": "post_ln", "norm": "post_ln"}
    config, tags, group = run_records(tmp_path / "run")
    assert group == "study-twt_lowres-smoke"
    assert {"study:twt_lowres", "arm:post_ln_lr2e-3", "budget:smoke"} <= set(tags)
    assert config["labels"]["arm"] == "post_ln_lr2e-3"  # W&B groups by config keys: labels.arm
    # the offline run says where it is and how to upload it
    (folder,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    assert f"W&B offline run: {folder}; upload it with `wandb sync {folder}`" in caplog.messages


@pytest.mark.integration
def test_a_study_logs_its_verdict_table_to_wandb(tmp_path, monkeypatch, capsys):
    """normlab-study --report-only on records: the README's verdicts as a wandb.Table in an offline W&B run
    of the study's group (read back from the run's files), and a line naming it."""
    from normlab.commands import study as study_cmd
    from normlab.study.dashboard import COLUMNS

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    path = write_study_file(tmp_path, [claim()])
    for arm, values in (("a", [12.0, 13.0, 12.5]), ("b1", [10.0, 10.5, 10.2])):
        for seed, bleu in enumerate(values, 1):
            record(tmp_path / "out", arm, seed, test_bleu=bleu, valid_bleu=10.0)
    code = study_cmd.main([str(path), "--report-only", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")])
    assert code == 0
    claims = json.loads((tmp_path / "out" / "claims.json").read_text())["claims"]
    (folder,) = (tmp_path / "runs" / "wandb").glob("offline-run-*")
    assert f"W&B offline run: {folder}; upload it with `wandb sync {folder}`" in capsys.readouterr().out
    (table_file,) = folder.glob("files/media/table/verdicts_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(COLUMNS)
    (row,) = table["data"]
    got = dict(zip(COLUMNS, row))
    assert (got["id"], got["verdict"], got["better"], got["than"]) == ("c", claims[0]["verdict"], "a", "b1")
    assert got["difference"] == pytest.approx(claims[0]["difference"]["mean"])
    assert (got["low"], got["high"]) == pytest.approx((claims[0]["difference"]["low"], claims[0]["difference"]["high"]))
    _, tags, group = run_records(folder.parent.parent)
    assert group == "study-s" and "study:s" in tags
