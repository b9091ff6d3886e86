"""A record folder is written whole and the old one kept until the new one is in place (study/record_swap.py):
runner.write_record, runner.adopt_shared and screen_run.adopt_rung all fill a temp folder and swap it in
by renames, so a write stopped between the two renames leaves the old record as `.old`, which this
study's readers read as the record, and the next write puts it back and replaces it. Fake records."""
import json
import os
from pathlib import Path

import pytest

from normlab.study.damaged import read_results
from normlab.study.plan import make_job
from normlab.study.records import load_records
from normlab.study.runner import adopt_shared, write_record
from normlab.study.screen import metrics_csv
from normlab.study.screen_run import adopt_rung, screen_jobs

from test_study_screen_status import W2, tiny  # noqa: F401 (tiny: the fixture)


def folder(path: Path, res: dict, metrics: str | None = "epoch,step,train/loss,valid/loss\n0,2,,5.0\n") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps(res))
    if metrics:
        (path / "metrics.csv").write_text(metrics)
    return path


def _rung_write(study, runs, out, tmp_path):
    """A rung record at step 3 and write_record's job: its run folder, paused at step 6."""
    job = screen_jobs(study, study.arms["a"], runs, out, [W2], 6)[W2]
    res = {"status": "stopped", "steps": 6, "cpu_s": 60.0, "identity_hash": job.identity_hash}
    folder(job.run_dir, res, metrics=None)
    (job.run_dir / "csv").mkdir()
    (job.run_dir / "csv" / "metrics.csv").write_text("epoch,step,train/loss,valid/loss\n0,5,,4.0\n")
    return job, lambda: write_record(study, job, res, rung=6)


def _rung_adopt(study, runs, out, tmp_path):
    """A rung record at step 3 and adopt_rung's job: another study's record of the run at step 6."""
    job = screen_jobs(study, study.arms["a"], runs, out, [W2], 6)[W2]
    res = {"status": "stopped", "steps": 6, "rung": 6, "cpu_s": 60.0, "identity_hash": job.identity_hash}
    src = folder(tmp_path / "other" / "screen" / "a" / W2, res)
    return job, lambda: adopt_rung(study, job, res, src)


def _seed_adopt(study, runs, out, tmp_path):
    """A seed's record not finished and adopt_shared's job: another study's finished record of the run."""
    arm = study.arms["b"]
    job = make_job(study, arm, 1, study.arm_overrides(arm, 1), runs, out / "runs" / "b-s1")
    res = {"status": "completed", "steps": 12, "identity_hash": job.identity_hash, "study": {"seed": 1}}
    folder(tmp_path / "other" / "runs" / "b-s1", res)
    return job, lambda: adopt_shared([job], tmp_path)


@pytest.mark.parametrize("writer", [_rung_write, _rung_adopt, _seed_adopt], ids=["write_record", "adopt_rung",
                                                                                 "adopt_shared"])
def test_a_write_stopped_between_its_renames_keeps_the_old_record(tiny, tmp_path, monkeypatch, writer):
    # before: the old record was removed before the new one was renamed into place, so a stop there lost both
    study, runs, out, _ = tiny
    job, write = writer(study, runs, out, tmp_path)
    old = {"status": "stopped", "steps": 3, "rung": 3, "cpu_s": 30.0, "identity_hash": job.identity_hash,
           "study": {"name": "st", "arm": job.arm.name, "seed": 1}}
    folder(job.record, old)
    replace = os.replace

    def stop_at_the_new_one(src, dst):  # the rename of the filled temp folder into place fails once
        if Path(src).name.endswith(".tmp") and not calls:
            calls.append(src)
            raise OSError("stopped")
        return replace(src, dst)
    calls = []
    monkeypatch.setattr(os, "replace", stop_at_the_new_one)
    with pytest.raises(OSError):
        write()
    assert read_results(job.record / "results.json", record=True)["steps"] == 3  # read from `.old`
    assert metrics_csv(job.record).read_text().endswith("0,2,,5.0\n")
    if job.record.parent.name == "runs":
        assert [r.results["steps"] for r in load_records(out)["b"]] == [3]
    write()  # the next write puts the old record back, then replaces it whole
    assert read_results(job.record / "results.json", record=True)["steps"] in (6, 12)
    assert sorted(p.name for p in job.record.parent.iterdir() if p.name.startswith(".")) == []


def test_only_record_swap_writes_a_record_folder_by_renames():
    # before: runner.write_record, runner.adopt_shared and screen_run.adopt_rung each had their own copy
    study = Path(__file__).resolve().parents[1] / "src" / "normlab" / "study"
    writers = [p.name for p in sorted(study.glob("*.py")) if 'with_name(f".{' in p.read_text(encoding="utf-8")]
    assert writers == ["record_swap.py"]
