"""The index of every claim, experiments/README.md: one row per claim of every full-budget study
(from its claims.json, between the markers; the rest of the page is kept) and what the studies cost."""
from __future__ import annotations

import json
from pathlib import Path

from normlab.study.verdict_text import INDEX_HEADER, index_row
from normlab.study.wandb_groups import group_text

BEGIN, END = "<!-- claims:begin (normlab-study writes this table) -->", "<!-- claims:end -->"
INDEX_TEXT = ("\"ours\": the interval that decides each comparison: t over the paired seeds at the df shown, each "
              "arm's seed variance pooled within its regime family where one is named, + the test sentences' "
              "variance for BLEU claims (each study's README shows the per-run test-set check beside it). fails and "
              "trains claims are judged on how the runs ended, trains against the study's reference arm where it "
              "names one. The paper's effect is the paper's own comparison, where the claim quotes it.")


def cost_table(folder: Path) -> list[str]:
    """What each study cost this machine (its README's Cost line) and the total of the training
    studies, where a run that several studies recorded (the same identity: a shared run folder, or an
    adopted record) counts once, and each study's screens add their CPU-hours beyond its seed records
    (claims.json `cost.screens`, screen_report.screens_total: each CPU second already in the study
    whose machine spent it, so summing them counts a shared screen run once)."""
    rows, total, screens = [], {}, 0.0
    for path in sorted(folder.glob("*/claims.json")):
        data = json.loads(path.read_text())
        c = data.get("cost")
        if data.get("budget") != "full" or not c:
            continue
        rows.append(_cost_row(data, c, path.parent.name))
        if data.get("kind") != "probe":
            by_run = c.get("cpu_by_run") or {k: 2 * h for k, h in (c.get("hours_by_run") or {}).items()}
            for run, h in by_run.items():
                total.setdefault(run, h)
            screens += _screen_hours(c) or 0.0
    if not rows:
        return []
    total_runs, total_hours = len(total), sum(total.values()) + screens
    return ["## What the studies cost", "",
            "CPU-hours: the CPU time each run used over all its legs (results.json `cpu_s`); for a run "
            "recorded before runs counted it, its wall time x its share of the machine (1 / the runs beside "
            "it, at most its threads of the cores) x the cores, an upper bound (each study's Cost line says "
            "how many). A 2-core machine gives 2 CPU-hours an hour. Screens: the CPU-hours of a study's "
            "screens beyond its seed records (the settings' runs to where each left, work redone after a "
            "fresh clone included; a run another study trained counted there; — where it has no screen); the "
            "total's CPU-hours include them.", "",
            "| study | runs recorded (of planned) | steps | CPU-hours | screens' CPU-hours |",
            "|---|---|---|---:|---:|", *rows,
            f"| **training studies, total** (a run several studies recorded counts once) | {total_runs} runs | | "
            f"**{total_hours:.2f}** | {screens:.2f} |"]


def _cost_row(data: dict, c: dict, folder: str) -> str:
    """A study's row of the cost table."""
    own = c["runs"] - c.get("shared", 0)
    shared = f" (+{c['shared']} shared with {', '.join(c.get('shared_with', []))})" if c.get("shared") else ""
    unit = "probes" if data.get("kind") == "probe" else "runs"
    steps = ", ".join(map(str, c.get("steps") or [])) if unit == "runs" else ""  # a probe trains no steps
    cpu = c.get("cpu_hours")  # a claims.json written before CPU-hours: its machine-hours x 2 cores
    hours = cpu if cpu is not None else 2 * c["machine_hours"]
    screen = _screen_hours(c)
    return (f"| [{data['study']}]({folder}/) | {own}{shared} of {c['planned']} {unit} | {steps or '—'} | "
            f"{hours:.2f}{'' if cpu is not None else ' (est.)'} | {'—' if screen is None else f'{screen:.2f}'} |")


def _screen_hours(c: dict) -> float | None:
    """A study's screens' CPU-hours from its claims.json cost; None: no screen (or a claims.json from
    before the index counted screens: its README's Cost line has them)."""
    s = c.get("screens")
    h = s.get("hours") if isinstance(s, dict) else None
    return float(h) if isinstance(h, (int, float)) and not isinstance(h, bool) else None


def group_table(folder: Path) -> list[str]:
    """Where the full-budget studies' runs are in W&B, for each study with runs outside its own group
    (study-<name>): a renamed study's runs from before the rename are in its former name's group, which
    a newer study of that name uses too (wandb_groups.group_text, from claims.json's `cost.groups`)."""
    rows = []
    for path in sorted(folder.glob("*/claims.json")):
        data = json.loads(path.read_text())
        if data.get("budget") != "full":
            continue
        text = group_text(data["study"], "full", (data.get("cost") or {}).get("groups") or {},
                          tuple(data.get("formerly") or ()))
        if text:
            rows.append(f"- [{data['study']}]({path.parent.name}/): {text}")
    return ["## W&B groups", "", *rows, ""] if rows else []


def update_index(index: Path) -> None:
    """Rewrite the claims table of experiments/README.md from every study's claims.json."""
    rows = [INDEX_TEXT, "", *INDEX_HEADER]
    for path in sorted(index.parent.glob("*/claims.json")):
        data = json.loads(path.read_text())
        if data.get("budget") != "full":
            continue
        rows += [index_row(data["study"], path.parent.name, c) for c in data["claims"]]
    table = "\n".join([BEGIN, *rows, "", *group_table(index.parent), *cost_table(index.parent), END])
    text = index.read_text() if index.is_file() else "# Studies\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        rest = rest.split(END, 1)[1]
        while BEGIN in rest and END in rest.split(BEGIN, 1)[1]:  # a stale second copy of the table: dropped
            before, after = rest.split(BEGIN, 1)
            before = before.rstrip().removesuffix("## Every claim, judged").rstrip() + "\n"
            rest = before + after.split(END, 1)[1]
        text = head + table + rest
    else:
        text = text.rstrip() + "\n\n## Every claim, judged\n\n" + table + "\n"
    index.write_text(text)
