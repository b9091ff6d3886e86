"""Study files and records for the study tests (test_study*.py): a small study file (arms a, b1,
b2; best_of b_best), a record of one run, a claim, and the verdicts of claims on given rows."""
import json
from pathlib import Path

from normlab.study.claims import judge
from normlab.study.records import load_records
from normlab.study.spec import load_study


def write_study_file(tmp_path, claims, arms=None, extra="", families=None) -> Path:
    """families: {arm: family} (the arms' `family:` keys); extra: more top-level YAML."""
    arms = arms or {"a": ["norm=prenorm"], "b1": ["norm=postnorm", "optim.lr=1e-3"], "b2": ["norm=postnorm"]}
    lines = ["title: t", "paper: p", "question: q", "seeds: [1, 2, 3]", "arms:"]
    for name, ov in arms.items():
        family = f", family: {families[name]}" if families and name in families else ""
        lines.append(f"  {name}: {{overrides: [{', '.join(ov)}]{family}}}")
    lines += ["best_of:", "  b_best: {arms: [b1, b2], by: valid_bleu}", "claims:"]
    for c in claims:
        lines.append("  - " + json.dumps(c))
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "s.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def record(out: Path, arm: str, seed: int, status="completed", **metrics) -> None:
    d = out / "runs" / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    study = {"arm": arm, "seed": seed, **metrics.pop("study", {})}
    (d / "results.json").write_text(json.dumps({"status": status, "study": study, **metrics}))


def claim(**kw):
    return {"id": "c", "claim": "A beats B", "source": "paper", "paper": "+1", "better": "a", "than": "b1",
            "interval": "t", **kw}


def verdicts(tmp_path, claims, rows, **study_file):
    study = load_study(str(write_study_file(tmp_path, claims, **study_file)))
    out = tmp_path / "out"
    for row in rows:
        record(out, *row[:2], **row[2])
    return {v.claim.id: v for v in judge(study, load_records(out), None)}


def pairs(a, b, arm_b="b1", **extra_b):
    rows = [("a", s + 1, {"test_bleu": x, "valid_bleu": 10.0}) for s, x in enumerate(a)]
    rows += [(arm_b, s + 1, {"test_bleu": x, "valid_bleu": 10.0, **extra_b}) for s, x in enumerate(b)]
    return rows


def every_setting_composes(study, tmp_path, check=True) -> dict[str, list[str]]:
    """A screened study's screen settings compose for every screened arm (its rung runs are valid runs:
    the grid's corners, its first and last setting, as each compose costs ~0.8 s); returns a choice per
    screened arm (the last setting) so the study's main runs plan too."""
    from normlab.study.screen import setting_name
    from normlab.study.screen_run import screen_jobs

    if study.screen is None:
        return {}
    names = [setting_name(s) for s in study.screen.settings()]
    names = names[:1] + names[-1:] if check else names[-1:]
    chosen = {}
    for arm in (a for a in study.arms.values() if study.screened(a)):
        jobs = screen_jobs(study, arm, tmp_path / "runs", tmp_path / "out", names, study.screen.rungs[0])
        assert len({j.identity_hash for j in jobs.values()}) == len(set(names))  # each setting its own run
        chosen[arm.name] = jobs[names[-1]].overrides[-len(study.screen.grid):]
    return chosen
