"""experiment=quick's promise (issue 37 item 12): a test BLEU of at least 15 after about five minutes
of training on 2 CPU cores. The README states what the run on record printed; the record is the run's
own results.json (benchmarks/records/quick_amd_epyc*.results.json, one a machine), so the README, the preset and the
record cannot drift apart. Slow: the whole preset (~6 minutes on the 2-core AMD EPYC)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import compose_cfg

from normlab.identity import identity_hash

ROOT = Path(__file__).resolve().parents[1]
# the runs on record, one per machine the README names (AVX2, then AVX-512 EPYC)
RECORDS = [ROOT / "benchmarks" / "records" / f"quick_amd_epyc{s}.results.json" for s in ("", "_avx512")]
PRESET = ROOT / "conf" / "experiment" / "quick.yaml"


def readme_claim() -> tuple[float, int]:
    """The README's line: "... `experiment=quick` ... test BLEU **18.23** after 750 steps ..."."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"experiment=quick`[^\n]*?test BLEU \*\*(\d+\.\d+)\*\* after (\d+) steps", text)
    assert m, "the README no longer states experiment=quick's test BLEU and steps"
    return float(m[1]), int(m[2])


def readme_bleus() -> list[float]:
    """Every test BLEU the README's experiment=quick paragraph states (one per machine, in bold)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("`experiment=quick` trained for")
    return [float(b) for b in re.findall(r"test BLEU \*\*(\d+\.\d+)\*\*", text[start:text.index("\n\n", start)])]


def test_the_readme_states_the_quick_runs_on_record():
    bleu, steps = readme_claim()
    recs = [json.loads(r.read_text()) for r in RECORDS]
    preset = yaml.safe_load(PRESET.read_text())
    assert readme_bleus() == [rec["test_bleu"] for rec in recs] and recs[0]["test_bleu"] == bleu
    for rec in recs:
        assert rec["status"] == "completed" and rec["test_bleu"] >= 15
        assert rec["steps"] == steps == preset["trainer"]["max_steps"]  # the record is the preset as it stands
        layers = preset["model"]["encoder_layers"], preset["model"]["decoder_layers"]
        assert f"-e{layers[0]}d{layers[1]}-" in rec["name"] and "AMD EPYC" in rec["device"]
        # every setting that names a run (lr, clipping, warmup, ...): the record ran the preset as it stands
        assert identity_hash(compose_cfg(["experiment=quick"])) == rec["identity_hash"]
    assert [("AVX512" in rec["device"]) for rec in recs] == [False, True]


@pytest.mark.integration
@pytest.mark.slow
def test_the_quick_preset_reaches_bleu_15(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "experiment=quick", "logger=csv", f"run_dir={tmp_path / 'run'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == "completed" and res["steps"] == readme_claim()[1]
    assert res["test_bleu"] >= 15, (res["test_bleu"], res["device"])
    assert f"test: BLEU {res['test_bleu']:.2f}" in r.stdout + r.stderr
