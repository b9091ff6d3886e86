"""Runs two studies share (the same resolved config, so the same identity) are trained once on any
machine: a study adopts another study's committed record of the run (runner.adopt_shared), marks
it `shared_from`, and its Cost line counts the run's machine-hours in the study that trained it."""
import json
import os
import shutil
from pathlib import Path

import pytest

from normlab.study.readme import cost
from normlab.study.records import load_records
from normlab.study.plan import plan
from normlab.study.runner import adopt_shared, record_done
from normlab.study.spec import load_study

ROOT = Path(__file__).resolve().parents[1]


def committed(tmp_path, *studies) -> Path:
    """A copy of experiments/ with the given studies' records."""
    root = tmp_path / "experiments"
    for name in studies:
        shutil.copytree(ROOT / "experiments" / name / "runs", root / name / "runs")
    return root


def test_layerdrop_prune_adopts_droheads_no_drophead_runs_as_its_scratch_model(tmp_path):
    root = committed(tmp_path, "drophead_4k")
    study = load_study("layerdrop_prune_4k")
    jobs = plan(study, tmp_path / "runs", root / "layerdrop_prune_4k")
    said = []
    adopted = adopt_shared(jobs, root, said.append)
    assert sorted(j.tag for j in adopted) == ["scratch3 seed 1", "scratch3 seed 2"]
    assert all(record_done(j) is not None for j in adopted)  # the sweep skips them
    assert all(record_done(j) is None for j in jobs if j not in adopted)  # the rest still train
    assert said[0] == "shared scratch3 seed 1: the run drophead_4k/none-s1 recorded (same identity)"
    by_arm = load_records(root / "layerdrop_prune_4k")
    (s1, s2) = by_arm["scratch3"]
    source = json.loads((root / "drophead_4k" / "runs" / "none-s1" / "results.json").read_text())
    assert s1.results["test_bleu"] == source["test_bleu"] and s1.seed == 1 and s2.seed == 2
    assert s1.results["shared_from"] == {"study": "drophead_4k", "record": "none-s1"}
    assert s1.results["study"]["name"] == "layerdrop_prune_4k" and s1.results["study"]["arm"] == "scratch3"
    assert (s1.path / "test.hyp.gz").read_bytes() == (root / "drophead_4k" / "runs" / "none-s1" / "test.hyp.gz").read_bytes()
    # counted once: the drophead study paid for these runs
    c = cost(by_arm)
    assert c["runs"] == 2 and c["shared"] == 2 and c["machine_hours"] == 0 and c["shared_with"] == ["drophead_4k"]
    # a second call adopts nothing more and does not adopt from the copies it made
    assert adopt_shared(jobs, root) == []
    # the source rescored (its study reran its final passes): the copy follows it, and only it
    src = root / "drophead_4k" / "runs" / "none-s1" / "results.json"
    src.write_text(json.dumps({**source, "test_bleu": source["test_bleu"] + 1.0}))
    assert [j.tag for j in adopt_shared(jobs, root)] == ["scratch3 seed 1"]
    assert load_records(root / "layerdrop_prune_4k")["scratch3"][0].results["test_bleu"] == source["test_bleu"] + 1.0
    assert adopt_shared(jobs, root) == []


def test_nothing_is_adopted_across_identities_unfinished_runs_or_without_prune_translations(tmp_path):
    root = committed(tmp_path, "drophead_4k", "layerdrop_prune_2k")
    none_s1 = root / "drophead_4k" / "runs" / "none-s1" / "results.json"
    res = json.loads(none_s1.read_text())
    none_s1.write_text(json.dumps(dict(res, status="preempted")))  # not finished: trained again
    jobs = plan(load_study("layerdrop_prune_4k"), tmp_path / "runs", root / "layerdrop_prune_4k")
    assert [j.tag for j in adopt_shared(jobs, root)] == ["scratch3 seed 2"]
    # layerdrop_prune_2k's 2,000-step runs are other runs (another identity): none is adopted,
    # and a pruned arm whose source record has no pruned translations is not adopted either
    (job,) = [j for j in jobs if j.tag == "ld0 seed 1"]
    fake = root / "other" / "runs" / "x-s1"
    fake.mkdir(parents=True)
    (fake / "results.json").write_text(json.dumps({"status": "completed", "identity_hash": job.identity_hash,
                                                   "study": {"name": "other", "arm": "x", "seed": 1}}))
    assert adopt_shared([job], root) == []
    (fake / "prune.json").write_text(json.dumps({"rows": [{"strategy": st, "kept": 3}
                                                          for st in ("every_other", "search_on_valid")]}))
    for st in ("every_other", "search_on_valid"):
        (fake / f"prune.{st}.r3.test.hyp.gz").write_bytes(b"")
    assert adopt_shared([job], root) == [job]


def test_the_cost_line_says_which_runs_were_shared(tmp_path):
    from normlab.study.claims import judge
    from normlab.study.readme import write_study

    root = committed(tmp_path, "drophead_4k")
    study = load_study("layerdrop_prune_4k")
    out = root / "layerdrop_prune_4k"
    adopt_shared(plan(study, tmp_path / "runs", out), root)
    by_arm = load_records(out)
    text = write_study(study, by_arm, judge(study, by_arm, None), out, "normlab-study layerdrop_prune_4k").read_text()
    assert ("2 runs of 4000 steps, 0.00 CPU-hours (the CPU time each run used, over all its legs; device not "
            "recorded; seeds" in text
            and "; 2 of the runs shared with drophead_4k (the same runs, trained once; their CPU-hours are "
                f"counted there); 2 of {study.planned} planned runs recorded" in text)


def test_the_total_counts_a_run_several_studies_recorded_once(tmp_path):
    """twt_lowres_2k, twt_scalenorm_2k and layerdrop_prune_2k hold the same pre-LN runs (one run folder,
    three records): the index's total counts them once."""
    from normlab.study.index import cost_table

    for name, hashes in (("a", {"h1": 1.0, "h2": 0.5}), ("b", {"h1": 1.0, "h3": 0.25})):
        (tmp_path / name).mkdir()
        c = {"runs": len(hashes), "machine_hours": sum(hashes.values()), "steps": [2000], "seeds": [1],
             "shared": 0, "shared_with": [], "planned": 2, "hours_by_run": hashes,
             "cpu_hours": sum(hashes.values()), "cpu_by_run": hashes}
        (tmp_path / name / "claims.json").write_text(json.dumps({"study": name, "budget": "full", "cost": c,
                                                                 "claims": []}))
    table = "\n".join(cost_table(tmp_path))
    assert "| [a](a/) | 2 of 2 runs | 2000 | 1.50 |" in table and "| [b](b/) | 2 of 2 runs | 2000 | 1.25 |" in table
    assert "| 3 runs | | **1.75** |" in table  # h1 once
    # a claims.json from before CPU-hours: its machine-hours on a 2-core machine, marked an estimate
    c.pop("cpu_hours"), c.pop("cpu_by_run")
    (tmp_path / "b" / "claims.json").write_text(json.dumps({"study": "b", "budget": "full", "cost": c, "claims": []}))
    table = "\n".join(cost_table(tmp_path))
    assert "| [b](b/) | 2 of 2 runs | 2000 | 2.50 (est.) |" in table and "| 3 runs | | **2.00** |" in table


def test_a_record_being_written_and_a_prune_that_does_not_cover_the_arm_are_not_adopted(tmp_path):
    root = committed(tmp_path, "drophead_4k")
    jobs = plan(load_study("layerdrop_prune_4k"), tmp_path / "runs", root / "layerdrop_prune_4k")
    none_s1 = root / "drophead_4k" / "runs" / "none-s1"
    os.replace(none_s1, none_s1.with_name(".none-s1.tmp"))  # write_record's temp folder, mid-write
    assert [j.tag for j in adopt_shared(jobs, root)] == ["scratch3 seed 2"]
    assert [r.seed for r in load_records(root / "drophead_4k")["none"]] == [2, 3]  # s1 not read as a record either
    (job,) = [j for j in jobs if j.tag == "ld0.5_learned seed 1"]
    src = root / "other" / "runs" / "x-s1"
    src.mkdir(parents=True)
    (src / "results.json").write_text(json.dumps({"status": "completed", "identity_hash": job.identity_hash}))
    rows = [{"strategy": "every_other", "kept": 3}, {"strategy": "search_on_valid", "kept": 3}]
    (src / "prune.json").write_text(json.dumps({"rows": rows}))
    for st in ("every_other", "search_on_valid"):
        (src / f"prune.{st}.r3.test.hyp.gz").write_bytes(b"")
    assert adopt_shared([job], root) == []  # the arm also prunes data_driven
    (src / "prune.json").write_text(json.dumps({"rows": rows + [{"strategy": "data_driven", "kept": 3}]}))
    (src / "prune.data_driven.r3.test.hyp.gz").write_bytes(b"")
    assert adopt_shared([job], root) == [job]
