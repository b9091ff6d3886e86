"""A run two studies share (the same identity: one run folder in studies/runs/, or a record copied
from the study that trained it) keeps the labels of the study and arm it was trained as, in its
results.json and its W&B run, which cannot be regrouped afterwards; each study's record says which
of its arms holds it, and everything that shows a study's runs reads the record: the study's README
(records by arm), `report --rows arm` on the records and `normlab-runs` (was: the two commands showed
the first study's study and arm for the second study's record). Labels stay out of the identity."""
import json
from pathlib import Path
from types import SimpleNamespace

from normlab import identity
from normlab.commands import runs as runs_cmd
from normlab.commands.common import main_guard
from normlab.commands.report_runs import find_runs, key_of
from normlab.study.records import load_records
from normlab.study.runner import write_record

from conftest import compose_cfg


def trained_by_a(run_dir, arm: str, study: str = "a_study") -> dict:
    """A run folder's results.json as a study's sweep leaves it (labels: the study and arm it was trained as)."""
    run_dir.mkdir(parents=True)
    res = {"status": "completed", "steps": 40, "planned_steps": 40, "seed": 1, "test_bleu": 12.5, "valid_bleu": 11.0,
           "group": f"study-{study}", "identity_hash": "abc123",
           "labels": {"study": study, "arm": arm, "budget": "full", "norm": "pre_ln", "data": "bible_de_en"}}
    (run_dir / "results.json").write_text(json.dumps(res))
    return res


def recorded_by(study: str, arm: str, run_dir, res: dict, out) -> None:
    """The record a study writes of the run (study/runner.write_record), as one of its arms."""
    job = SimpleNamespace(record=out / "runs" / f"{arm}-s1", arm=SimpleNamespace(name=arm), seed=1,
                          overrides=["norm=prenorm"], run_dir=run_dir)
    job.record.parent.mkdir(parents=True, exist_ok=True)
    write_record(SimpleNamespace(name=study, budget="full"), job, res)


def test_the_second_studys_record_is_shown_as_its_own_arm(tmp_path, capsys):
    run_dir = tmp_path / "studies" / "runs" / "bible_de_en-pre_ln-s1-abc123"
    res = trained_by_a(run_dir, "pre_ln")
    out_a, out_b = tmp_path / "experiments" / "a_study", tmp_path / "experiments" / "b_study"
    recorded_by("a_study", "pre_ln", run_dir, res, out_a)
    recorded_by("b_study", "scratch", run_dir, res, out_b)  # b_study reached the same run, finished
    record_b = json.loads((out_b / "runs" / "scratch-s1" / "results.json").read_text())
    # the run's labels stay the ones it was trained as (its W&B run has them); the record says who holds it
    assert record_b["labels"]["study"] == "a_study" and record_b["labels"]["arm"] == "pre_ln"
    assert (record_b["study"]["name"], record_b["study"]["arm"]) == ("b_study", "scratch")
    # the study's README reads its records by arm
    assert list(load_records(out_b)) == ["scratch"] and list(load_records(out_a)) == ["pre_ln"]
    # report --rows arm / study on each study's records: the holder's arm and study
    (run_b,) = find_runs([str(out_b / "runs")])
    (run_a,) = find_runs([str(out_a / "runs")])
    assert key_of(run_b, ["study", "arm"]) == ("b_study", "scratch")
    assert key_of(run_a, ["study", "arm"]) == ("a_study", "pre_ln")
    assert key_of(run_b, ["norm"]) == ("pre_ln",)  # the other labels: the resolved values that ran
    # normlab-runs, on the records and on the shared run folder
    assert main_guard(runs_cmd.main, [str(tmp_path / "experiments"), str(tmp_path / "studies"), "--json"]) == 0
    rows = {str(Path(r["path"]).relative_to(tmp_path.resolve())): (r["study"], r["arm"])
            for r in json.loads(capsys.readouterr().out)}
    assert rows == {"experiments/a_study/runs/pre_ln-s1": ("a_study", "pre_ln"),
                    "experiments/b_study/runs/scratch-s1": ("b_study", "scratch"),
                    f"studies/runs/{run_dir.name}": ("a_study", "pre_ln")}  # the run folder: as it was trained

def test_labels_are_not_part_of_the_identity():
    """The same run, whichever study and arm start it: one identity hash, so one run folder."""
    base = ["norm=prenorm", "seed=1"]
    a = compose_cfg([*base, "labels.study=a_study", "labels.arm=pre_ln"])
    b = compose_cfg([*base, "labels.study=b_study", "labels.arm=scratch"])
    assert identity.identity_hash(a) == identity.identity_hash(b) == identity.identity_hash(compose_cfg(base))
    assert identity.labels(a)["arm"] == "pre_ln" and identity.labels(b)["arm"] == "scratch"
    assert "labels" in identity.NOT_IDENTITY
