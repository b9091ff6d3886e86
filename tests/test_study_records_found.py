"""Upgrades do not orphan studies: every record committed under experiments/<study>/runs/ is the
run its study would launch today (the same identity hash), so `normlab-study NAME` skips it instead
of training it again. A failure here means a change renamed runs (a new key not in
identity.NEUTRAL, a changed default): keep the old identity instead of recording the runs anew."""
import json
from pathlib import Path

import pytest

from normlab.study.plan import plan
from normlab.study.runner import record_done
from normlab.study.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted(p.parents[2].name for p in (ROOT / "experiments").glob("*/runs/*/results.json")
                 if (ROOT / "conf" / "study" / f"{p.parents[2].name}.yaml").is_file())


@pytest.mark.parametrize("name", sorted(set(STUDIES)))
def test_every_committed_record_is_a_run_the_study_launches_today(name, tmp_path):
    study = load_study(name)
    if study.kind == "probe":
        pytest.skip("a probe study records probes, not runs")
    out = ROOT / "experiments" / name
    jobs = plan(study, tmp_path / "runs", out)
    recorded = {p.parent.name: json.loads(p.read_text()) for p in (out / "runs").glob("*/results.json")}
    by_record = {j.record.name: j for j in jobs}
    for record, res in recorded.items():
        job = by_record.get(record)
        assert job is not None, f"{name}: record {record} is no arm and seed of the study"
        assert res.get("identity_hash") == job.identity_hash, f"{name}/{record}: renamed by a change"
        assert record_done(job) is not None or res.get("status") not in ("completed", "diverged", "stalled")
