"""Every shipped study plans the runs its records were: its arms compose and validate at each
budget, its committed records are the runs it plans (same identity hash), and runs shared between
studies are one folder (split from test_study.py, issue 37: one file no longer holds a worker's tail)."""
import json
import re
from pathlib import Path

import pytest
import yaml

from normlab.study.plan import plan
from normlab.study.spec import available, load_study
from study_files import every_setting_composes

ROOT = Path(__file__).resolve().parents[1]
# Every shipped study file, read from conf/study (a new one is checked without editing this list):
# training studies (arms are runs) and probe studies (a measurement at init, normlab.study.probe).
KINDS = {p.stem: (yaml.safe_load(p.read_text()) or {}).get("kind", "train")
         for p in (ROOT / "conf" / "study").glob("*.yaml")}
STUDIES = sorted(n for n, kind in KINDS.items() if kind == "train")
PROBES = sorted(n for n, kind in KINDS.items() if kind == "probe")


def planned_jobs(name, budget, tmp_path, corners=False):
    """The study's jobs at a budget, each composed and validated as the study command does first;
    corners: both corners of each screen grid compose too, not only the setting the plan uses."""
    study = load_study(name, budget)
    chosen = every_setting_composes(study, tmp_path, check=corners)
    jobs = plan(study, tmp_path / "runs", tmp_path / "out", chosen)
    assert len(jobs) == study.planned
    assert len({j.run_name for j in jobs}) == len(jobs)  # every (arm, seed) its own run
    for c in study.claims:
        assert c.better in study.arms or c.better in study.best_of
    return jobs


def test_every_shipped_study_plans(tmp_path):
    """Every arm of every study composes and validates at both budgets (what the command checks
    before any run), and every record committed in experiments/ is the run its study plans (the
    same identity hash): a change to what names a run would otherwise leave the records unfound and
    train them again."""
    assert set(STUDIES) | set(PROBES) == set(available()) and len(STUDIES) >= 7 and "output_change" in PROBES
    for name in PROBES:  # a probe trains nothing (normlab.study.probe): it loads and validates at both budgets
        for budget in ("full", "smoke"):
            assert load_study(name, budget).kind == "probe"
    checked = 0
    for name in STUDIES:
        planned_jobs(name, "smoke", tmp_path, corners=True)  # each screen setting its own run
        planned = {f"{j.arm.name}-s{j.seed}": j.identity_hash for j in planned_jobs(name, "full", tmp_path)}
        for res in sorted((ROOT / "experiments" / name / "runs").glob("*/results.json")):
            rec = res.parent.name
            assert planned.get(rec) == json.loads(res.read_text())["identity_hash"], f"{name}/runs/{rec}"
            checked += 1
    assert checked >= 67  # the records committed on 2026-11-26


# Slow: the first corner of each full-budget screen grid (~1 s a compose where a grid reaches config
# groups the plan does not: deep_recent, twt_scalenorm). The same property stays in the default
# suite: test_every_shipped_study_plans composes both corners of every smoke-budget grid (each its
# own run) and, at the full budget, the corner each plan uses.
@pytest.mark.slow
@pytest.mark.parametrize("name", STUDIES)
def test_every_screen_grid_corner_composes_at_full_budget(name, tmp_path):
    planned_jobs(name, "full", tmp_path, corners=True)


def test_studies_share_identical_arms(tmp_path):
    """The same resolved config is the same run folder in every study (trained once)."""
    lowres = {j.tag: j.run_name for j in plan(load_study("twt_lowres_2k"), tmp_path, tmp_path)}
    scalenorm = {j.tag: j.run_name for j in plan(load_study("twt_scalenorm_2k"), tmp_path, tmp_path)}
    prune = {j.tag: j.run_name for j in plan(load_study("layerdrop_prune_2k"), tmp_path, tmp_path)}
    assert lowres["pre_ln seed 1"] == scalenorm["pre_ln seed 1"] == prune["scratch3 seed 1"]
    prune = {j.tag: j.run_name for j in plan(load_study("layerdrop_prune_4k"), tmp_path, tmp_path)}
    drophead = {j.tag: j.run_name for j in plan(load_study("drophead_4k"), tmp_path, tmp_path)}
    assert prune["scratch3 seed 2"] == drophead["none seed 2"]  # the CPU default at 4,000 steps
    deep = {j.tag: j.run_name for j in plan(load_study("deep_bleu_2k"), tmp_path, tmp_path)}
    recent = {j.tag: j.run_name for j in plan(load_study("deep_recent_2k"), tmp_path, tmp_path)}
    assert deep["pre_ln seed 2"] == recent["pre_ln seed 2"] and deep["post_ln seed 1"] == recent["post_ln seed 1"]


def test_run_names_of_started_studies_are_pinned(tmp_path):
    """Runs already trained (twt_lowres_2k, started 2026-11-23 as twt_lowres under names without the
    corpus) keep their identity and their folders: a change that renamed them would train them again."""
    started = {"pre_ln seed 1": "pre_ln-xavier-none-e3d3-s1-1596a043",
               "post_ln_lr1e-3 seed 1": "post_ln-xavier-none-e3d3-s1-f190fdcd",
               "post_ln_lr2e-3 seed 2": "post_ln-xavier-none-e3d3-s2-bd15fb2d"}
    names = {j.tag: j.run_name for j in plan(load_study("twt_lowres_2k"), tmp_path, tmp_path)}
    for tag, old in started.items():
        assert names[tag] == "bible_de_en-" + old
        (tmp_path / old).mkdir()
        (tmp_path / old / "run.json").write_text(json.dumps({"identity_hash": old.rsplit("-", 1)[1]}))
    found = {j.tag: j.run_dir for j in plan(load_study("twt_lowres_2k"), tmp_path, tmp_path)}
    for tag, old in started.items():
        assert found[tag] == tmp_path / old


def test_every_training_study_names_a_paper_size_sweep_that_exists():
    sweeps = {p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml")}
    for name in STUDIES:
        study = load_study(name)
        cmd = study.paper_preset.get("command", "")
        used = re.findall(r"\+sweep=(\w+)", cmd)
        assert used and set(used) <= sweeps, (name, cmd)
        assert "GPU" in study.paper_preset.get("cost", "")
