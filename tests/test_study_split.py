"""A study rerun under a new regime (issue 35 item 8) keeps its first regime as a study of its own,
`<name>_<regime>` (deep_bleu_2k), with its records, so that every old verdict still stands on the
runs that gave it; the rerun judges the same claims, fixed before its data, and plans the run folders
it shares with another study exactly as that study does, so they are trained once."""
import json
from pathlib import Path

import pytest

from normlab.study.fixed import definition_hash
from normlab.study.plan import plan
from normlab.study.runner import record_done
from normlab.study.screen import setting_name
from normlab.study.screen_run import screen_jobs
from normlab.study.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
# the rerun -> its first regime, kept with its records
SPLITS = {"deep_bleu": "deep_bleu_2k", "deep_recent": "deep_recent_2k", "twt_lowres": "twt_lowres_2k",
          "twt_scalenorm": "twt_scalenorm_2k", "drophead": "drophead_4k", "layerdrop_prune": "layerdrop_prune_4k"}
# Claims whose definition the rerun changed on purpose, before its first records: deep_bleu judges its
# "trains where post-LN fails" claims on the screens too (`where_fails`, part of the definition).
CHANGED_BEFORE_DATA = {"deep_bleu": {"admin_trains_deep", "dlcl_post_trains_deep", "deepnorm_trains_deep"}}


@pytest.mark.parametrize("new, old", sorted(SPLITS.items()))
def test_the_rerun_judges_the_claims_of_its_first_regime(new, old):
    """Same ids, same order, and each definition (kind, margin, arms, metrics, direction) hashes as
    the first regime's: the claims were fixed before the rerun's data."""
    rerun, first = load_study(new), load_study(old)
    assert [c.id for c in rerun.claims] == [c.id for c in first.claims]
    changed = {c.id for c, f in zip(rerun.claims, first.claims) if definition_hash(c) != definition_hash(f)}
    assert changed == CHANGED_BEFORE_DATA.get(new, set())
    assert (ROOT / "experiments" / old / "claims.lock.json").is_file()  # the first regime's verdicts, fixed


@pytest.mark.parametrize("old", sorted(SPLITS.values()))
def test_the_first_regime_plans_exactly_its_records(old, tmp_path):
    """Its planned runs are the records in experiments/<old>/runs/, by name and identity, all done:
    `normlab-study <old>` trains nothing, and its verdicts are the ones it had under the old name."""
    out = ROOT / "experiments" / old
    jobs = plan(load_study(old), tmp_path / "runs", out)
    records = {p.parent.name: json.loads(p.read_text()) for p in (out / "runs").glob("*/results.json")}
    assert sorted(j.record.name for j in jobs) == sorted(records)
    for job in jobs:
        assert records[job.record.name]["identity_hash"] == job.identity_hash, job.record.name
        assert record_done(job) is not None, job.record.name


def _corners(study) -> list[str]:
    names = [setting_name(s) for s in study.screen.settings()]
    return [names[0], names[-1]]  # each compose costs ~0.5-2 s


@pytest.mark.parametrize("first, second, arms", [("deep_bleu", "deep_recent", ["pre_ln", "post_ln"]),
                                                  ("twt_lowres", "twt_scalenorm", ["pre_ln"])])
def test_studies_that_share_arms_plan_the_same_run_folders(first, second, arms, tmp_path):
    """The arms two screened studies share are the same resolved config: the same screen runs (the
    same folder for each setting) and, once a setting is chosen, the same seeds, seed 1 being the
    chosen setting's screen run continued. So the runs are trained once for both studies."""
    a, b = load_study(first), load_study(second)
    assert (a.common, a.seeds, a.screen, a.plateau) == (b.common, b.seeds, b.screen, b.plateau)
    names = _corners(a)
    runs = tmp_path / "runs"
    chosen, screen_run = {}, {}
    for arm in arms:
        assert a.arms[arm].overrides == b.arms[arm].overrides
        sa = screen_jobs(a, a.arms[arm], runs, tmp_path / first, names, a.screen.rungs[0])
        sb = screen_jobs(b, b.arms[arm], runs, tmp_path / second, names, b.screen.rungs[0])
        assert {n: j.run_dir for n, j in sa.items()} == {n: j.run_dir for n, j in sb.items()}
        assert len({j.run_dir for j in sa.values()}) == len(names)  # each setting its own folder
        chosen[arm] = sa[names[-1]].overrides[-len(a.screen.grid):]  # say the screen chose the last setting
        screen_run[arm] = sa[names[-1]].run_dir
    ja = {j.tag: j for j in plan(a, runs, tmp_path / first, chosen)}
    jb = {j.tag: j for j in plan(b, runs, tmp_path / second, chosen)}
    tags = [f"{arm} seed {s}" for arm in arms for s in a.seeds]
    assert sorted(ja) == sorted(jb) == sorted(tags)  # the other arms wait for their screens
    for tag in tags:
        assert ja[tag].run_dir == jb[tag].run_dir and ja[tag].identity_hash == jb[tag].identity_hash, tag
    for arm in arms:  # seed 1 continues the chosen setting's screen run
        assert ja[f"{arm} seed {a.screen.seed}"].run_dir == screen_run[arm]


def test_the_plateau_the_claims_read_is_the_one_the_runs_stop_at():
    """A study's `plateau:` (how its claims tell a run still improving: budget-bound) is the rule its
    runs stop by, where they stop at one (callbacks.plateau), and its cap is their trainer.max_steps; a
    V-shaped DropHead run has no plateau stop (its rate reaches p at trainer.max_steps, the end of its
    V, so a run stopped sooner would end part-way up it)."""
    from normlab.study.plan import compose
    from normlab.study.spec import available

    checked = 0
    for name in available():
        study = load_study(name)
        if study.plateau is None:
            continue
        first, *rest = study.arms.values()  # each compose ~1 s: the first arm, and those that change these
        for arm in [first, *(a for a in rest if any(o.split("=")[0].lstrip("+") in (
                "trainer.max_steps", "callbacks.plateau.window", "regularizer", "callbacks.drophead_schedule.schedule")
                for o in a.overrides))]:
            cfg = compose(study.arm_overrides(arm, study.seeds[0]))
            assert cfg.trainer.max_steps == study.plateau.cap, f"{name}.{arm.name}"
            stop = cfg.callbacks.plateau
            if stop.window is not None:
                assert (stop.window, stop.min_delta) == (study.plateau.window, study.plateau.min_delta), name
            if cfg.regularizer.drophead and cfg.callbacks.drophead_schedule.schedule == "v_shape":
                assert stop.window is None, f"{name}.{arm.name}: a plateau stop would cut its V short"
                checked += 1
    assert checked >= 1  # drophead's V-shaped arm
