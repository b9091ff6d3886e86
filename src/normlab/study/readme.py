"""A study's folder, written by the command that ran it: README.md (question, design, cost, table,
claims with verdicts (verdict_text.py), plots, the paper-size preset), table.csv, claims.json,
plots. The index of every claim, experiments/README.md, is index.py's."""
from __future__ import annotations

import csv
import json
import math
import os
import re
import time
from pathlib import Path

import numpy as np

from normlab.hardware import cpu_text
from normlab.study.claims import Verdict, statuses
from normlab.study.fixed import change_lines, moved_lines, update_lock
from normlab.study.pace import pace_lines
from normlab.study.records import Record
from normlab.study.screen_report import screen_lines, screens_cost, screens_total
from normlab.study.spec import Study
from normlab.study.verdict_text import claims_lines, fmt
from normlab.study.wandb_groups import group_text, groups


CHECKOUT = Path(__file__).resolve().parents[3]  # the docs/ a README in experiments/ links to


def docs_link(out: Path, page: str, section: str) -> str:
    """A link from a README written in `out` to a section of a docs/ page (the README's sections moved
    there); the page and section as text where `out` is outside this checkout."""
    text = f"docs/{page}, {section}"
    target, here = CHECKOUT / "docs" / page, out.resolve()
    if not target.is_file() or CHECKOUT not in here.parents:
        return text
    anchor = re.sub(r"[^\w\- ]", "", section.lower()).replace(" ", "-")  # GitHub's heading anchor
    return f"[{text}]({os.path.relpath(target, here)}#{anchor})"


def mean_sd(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}"


def _flat(prefix: str, node) -> list[str]:
    # A probe arm's ModelConfig options as dotted paths (model.norm.placement=post; not train.py
    # overrides), so its row names what it ran as a training arm's row names its overrides.
    if not isinstance(node, dict):
        return [] if node is None else [f"{prefix}={str(node).lower() if isinstance(node, bool) else node}"]
    return [kv for k, v in node.items() for kv in _flat(f"{prefix}.{k}", v)]


def arm_rows(study: Study, by_arm: dict[str, list[Record]]) -> list[dict]:
    rows = []
    for arm in study.arms.values():
        recs = by_arm.get(arm.name, [])
        row = {"arm": arm.name, "label": arm.label, "overrides": " ".join(arm.overrides or _flat("model", arm.model)),
               "seeds": ",".join(str(r.seed) for r in recs), "statuses": statuses(recs)}
        for m in study.table_metrics:
            row[m] = [r.metric(m) for r in recs if r.status == "completed" and r.metric(m) is not None]
        row["per_seed"] = {r.seed: (r.metric(study.table_metrics[0]), r.status) for r in recs}
        rows.append(row)
    return rows


def machine_share(res: dict) -> float:
    """The share of the machine a run used: 1 / the study's --jobs (the runs that shared it), and no
    more than its threads of the cores where results.json names them ("cpu: x86_64, 2 cores, 1
    thread"): a 1-thread run of a --jobs 1 study beside another study used half the machine, as a
    job of a 2-job sweep does, and 3 one-thread jobs on 2 cores a third each."""
    share = 1.0 / max(1, int((res.get("study") or {}).get("jobs") or 1))
    m = re.match(r"cpu: .*?, (\d+) cores, (\d+) threads?$", str(res.get("device") or ""))
    return min(share, int(m.group(2)) / int(m.group(1))) if m and int(m.group(1)) > 0 else share


def run_cpu_hours(res: dict) -> tuple[float, bool]:
    """(CPU-hours a run used, measured?): its results.json `cpu_s` over all its legs (hardware.py);
    a record from before CPU time was counted: its wall time x its share of the machine x the cores
    (machine_share: all of its share used, an upper bound; 1 core where the device names none)."""
    cpu = res.get("cpu_s")
    if isinstance(cpu, (int, float)) and not isinstance(cpu, bool) and math.isfinite(cpu) and cpu >= 0:
        return float(cpu) / 3600, True  # a negative or infinite one is damaged: estimated as if not recorded
    m = re.match(r"cpu: .*?, (\d+) cores, ", str(res.get("device") or ""))
    cores = int(m.group(1)) if m else 1
    return float(res.get("wall_s") or 0) * machine_share(res) * cores / 3600, False


def cost(by_arm: dict[str, list[Record]]) -> dict:
    """CPU-hours (issue 36: what each run used, not wall time x 1/jobs, which charged identical runs
    up to 3x apart under load it did not record) and the older machine-hours (wall time x share)."""
    recs = [r for rs in by_arm.values() for r in rs]
    own = [r for r in recs if not r.results.get("shared_from")]  # a shared run's cost is its study's
    wall = sum(float(r.results.get("wall_s") or 0) * machine_share(r.results) for r in own)
    steps = sorted({int(r.results.get("steps") or 0) for r in recs})
    shared = sorted({r.results["shared_from"].get("study", "?") for r in recs if r.results.get("shared_from")})
    hours = {str(r.results.get("identity_hash")): float(r.results.get("wall_s") or 0) / 3600 * machine_share(r.results)
             for r in own}
    cpu = {str(r.results.get("identity_hash")): run_cpu_hours(r.results) for r in own}
    # shared ones too; records from before d292872 say "1 threads": one device, spelled as today
    devices = sorted({re.sub(r"\b1 threads$", "1 thread", str(r.results.get("device") or "device not recorded"))
                      for r in recs})
    return {"runs": len(recs), "machine_hours": wall / 3600, "steps": steps, "seeds": sorted({r.seed for r in recs}),
            "cpu_hours": sum(h for h, _ in cpu.values()), "cpu_estimated": sum(not m for _, m in cpu.values()),
            "cpu_by_run": {k: h for k, (h, _) in cpu.items()},
            "devices": devices, "code": _code(recs), "cpus": _cpus(recs),
            "shared": len(recs) - len(own), "shared_with": shared, "hours_by_run": hours, "groups": groups(recs)}


def _cpu_basis(c: dict) -> str:
    """How the Cost line's CPU-hours were counted: measured, or estimated for older records."""
    own = c["runs"] - c.get("shared", 0)
    if not c.get("cpu_estimated"):
        return "the CPU time each run used, over all its legs"
    if c["cpu_estimated"] >= own:
        return ("estimated: each run's wall time x its share of the machine x its cores, an upper bound "
                "(recorded before runs counted their CPU time)")
    return (f"the CPU time each run used; for {c['cpu_estimated']} of {own} runs, recorded before runs counted "
            "it, their wall time x share of the machine x cores, an upper bound")


def _cpus(recs: list[Record]) -> str:
    """The CPUs and kernel paths that trained the runs (results.json `cpu`: hardware.py), for the
    Cost section: "AMD EPYC, AVX2 kernels (3 runs); not recorded (8 runs, trained before 2026-11-27)"."""
    counts: dict[str, int] = {}
    for r in recs:
        cpu = r.results.get("cpu")
        key = cpu_text(cpu) if isinstance(cpu, dict) else ""
        counts[key] = counts.get(key, 0) + 1
    runs = lambda n: f"{n} run{'s' if n != 1 else ''}"  # noqa: E731
    parts = [f"{k} ({runs(n)})" for k, n in sorted(counts.items()) if k]
    if counts.get(""):
        parts.append(f"not recorded ({runs(counts[''])}, trained before results.json named its CPU)")
    return "; ".join(parts)


def _code(recs: list[Record]) -> str:
    """The commits that trained the runs (results.json `code_legs`, else `code`: provenance.py), for
    the Cost section: "1c0cccd (2 runs), 26f455f → 33f0c29 (1 run), 80501ee+changes at its last leg
    (1 run); not recorded for 8 runs (trained before 80501ee)"."""
    def name(code: dict) -> str:  # no commit: not a git checkout, git not there to ask, or a leg before code_legs
        return (code["commit"][:7] if code.get("commit") else "commit unknown") + ("+changes" if code.get("dirty") else "")

    def key(res: dict) -> str:
        legs = res.get("code_legs") if isinstance(res.get("code_legs"), list) else None
        if not legs:  # a record from before code_legs existed: its last leg's code only
            return f"{name(res['code'])} at its last leg" if isinstance(res.get("code"), dict) else ""
        names = [name(leg) for leg in legs]
        return " → ".join(n for i, n in enumerate(names) if i == 0 or n != names[i - 1])
    counts: dict[str, int] = {}
    for k in (key(r.results) for r in recs):
        counts[k] = counts.get(k, 0) + 1
    runs = lambda n: f"{n} run{'s' if n != 1 else ''}"  # noqa: E731
    known = [f"{k} ({runs(n)})" for k, n in sorted(counts.items()) if k]
    text = ", ".join(known)
    if counts.get(""):
        text += ("; " if text else "") + f"not recorded for {runs(counts[''])} (trained before 80501ee)"
    return text


def write_study(study: Study, by_arm: dict[str, list[Record]], verdicts: list[Verdict], out: Path,
                command: str) -> Path:
    """A study's folder from its records and verdicts: the plots, claims.json and table.csv (the
    numbers, for programs), then README.md (the report, for readers), its sections in reading order."""
    out.mkdir(parents=True, exist_ok=True)
    rows = arm_rows(study, by_arm)
    c = cost(by_arm)
    plots = _plots(study, by_arm, out)
    probe_lines: list[str] = []
    if study.kind == "probe":
        plot, probe_lines = _probe_section(study, by_arm, out)
        plots.insert(0, plot)
    claims, changes = _write_claims(study, by_arm, verdicts, out, c)
    _write_table(study, by_arm, out)
    where = group_text(study.name, study.budget, c["groups"], study.formerly)
    lines = [*_head_lines(study, command), *_cost_lines(study, c, out), *([where, ""] if where else []),
             *screen_lines(study, out, max(c["steps"] or [0]) or None),
             "## Claims", "", *claims_lines(claims), *change_lines(changes), *moved_lines(out),
             *probe_lines, *_arm_lines(study, rows)]
    if study.kind == "train":
        lines += pace_lines(study, by_arm)
    for title, name in plots:
        lines += [f"![{title}]({name})", ""]
    lines += _reproduce_lines(study, command)
    (out / "README.md").write_text("\n".join(lines).rstrip() + "\n")
    return out / "README.md"


def _probe_section(study: Study, by_arm: dict[str, list[Record]], out: Path) -> tuple[tuple[str, str], list[str]]:
    """A probe study's plot (output change vs depth) and its README sections: the output change at init
    per depth, absolute and relative to ‖F(x;W)‖, and whether it grows linearly in N or in ln N."""
    from normlab.study.probe import depth_plot, depth_table, shape_lines

    plot = ("output change vs depth", depth_plot(study, by_arm, out))
    lines: list[str] = []
    for side in ("decoder", "encoder"):
        lines += [f"## Output change at init, {side} output (mean ± sd over {len(study.seeds)} seeds; "
                  "the sd as a share of the mean)", "", *depth_table(study, by_arm, side), "",
                  f"Relative to ‖F(x;W)‖ ({side}):", "", *depth_table(study, by_arm, side, relative=True), ""]
    shape = shape_lines(study, by_arm)
    if shape:
        lines += ["## Shape: linear in N or in ln N (fits on the seed means)", "", *shape, ""]
    return plot, lines


def _write_claims(study: Study, by_arm: dict[str, list[Record]], verdicts: list[Verdict], out: Path,
                  c: dict) -> tuple[list[dict], dict]:
    """claims.json (each verdict, the cost, and the claims whose definition changed after their first
    records: study/fixed.py's lock, updated here); returns the claims' dicts and those changes."""
    planned = study.planned
    claims = [v.as_dict() for v in verdicts]
    # claims fixed before their data (study/fixed.py): a definition changed since the first records is shown
    changes = update_lock(out, study.claims, {v.claim.id: v.verdict for v in verdicts},
                          has_records=any(by_arm.values()), today=time.strftime("%Y-%m-%d"))
    for entry in claims:
        if entry["id"] in changes:
            entry["changed_after_data"] = changes[entry["id"]]
    (out / "claims.json").write_text(json.dumps({"study": study.name, "budget": study.budget, "kind": study.kind,
                                                 "formerly": list(study.formerly),
                                                 "cost": {**c, "planned": planned, **_screens(study, out)},
                                                 "claims": claims}, indent=2) + "\n")
    return claims, changes


def _screens(study: Study, out: Path) -> dict:
    """claims.json's `cost.screens` (screen_report.screens_total: the screens' CPU-hours beyond the
    seed records, each CPU second in the study whose machine spent it), for the index's total."""
    return {"screens": screens_total(study, out)} if study.screen is not None else {}


def _write_table(study: Study, by_arm: dict[str, list[Record]], out: Path) -> None:
    """table.csv: one row per record (arm, seed, status, the table's metrics, steps, wall time)."""
    with open(out / "table.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "status", *study.table_metrics, "steps", "wall_s"])
        for arm in study.arms:
            for r in by_arm.get(arm, []):
                w.writerow([arm, r.seed, r.status, *[r.metric(m) for m in study.table_metrics],
                            r.results.get("steps"), r.results.get("wall_s")])


def _head_lines(study: Study, command: str) -> list[str]:
    """The README's title, the command that wrote it (not to be edited by hand), the paper, the
    question and the design."""
    lines = [f"# {study.title}", "",
             f"_Generated by `{command}` on {time.strftime('%Y-%m-%d')} (budget: {study.budget}); "
             "rerun it to update. Do not edit by hand._", "",
             f"**Paper:** {study.paper}", "", f"**Question:** {study.question}", ""]
    if study.design:
        lines += ["## Design (why this model, corpus and budget)", "", study.design.strip(), ""]
    return lines


def _cost_lines(study: Study, c: dict, out: Path) -> list[str]:
    """The Cost section: the runs, their CPU-hours and how they were counted, the devices and seeds;
    for a training study also the commits and the CPUs that trained the runs."""
    runs_of = (f"{c['runs']} probes ({len(study.seeds)} seeds x {len(study.arms)} arms, "
               f"{len(study.probe.get('depths', []))} depths each)" if study.kind == "probe"
               else f"{c['runs']} runs of {', '.join(map(str, c['steps'])) or '—'} steps")
    return ["## Cost", "",
            f"{runs_of}, "
            f"{c['cpu_hours']:.2f} CPU-hours ({_cpu_basis(c)}; {'; '.join(c.get('devices') or ['device not recorded'])}; "
            f"seeds {', '.join(map(str, c['seeds'])) or '—'}"
            + (f" of {', '.join(map(str, study.all_seeds))} planned" if c["seeds"] != list(study.all_seeds) else "")
            + _extra_seeds(study)
            + ")" + _shared(c) + _unfinished(study, c) + screens_cost(study, out) + ".", "",
            *([f"Code (the normlab commits that trained each run, → where a run continued on another): "
               f"{c['code'] or '—'}.", ""] if study.kind != "probe" else []),
            *([f"CPUs (a rerun matches a record to the bit only on the same kernel path: "
               f"{docs_link(out, 'results-and-determinism.md', 'Determinism')}): {c['cpus']}.", ""]
              if study.kind != "probe" and c.get("cpus") else [])]


def _arm_lines(study: Study, rows: list[dict]) -> list[str]:
    """The Arms section: each arm's mean ± sd per table metric over its completed seeds, what end.<series>
    means where shown, and the first metric per seed."""
    metrics = study.table_metrics
    lines = ["## Arms (mean ± sd over completed seeds)", "",
             f"| arm | {'model options' if study.kind == 'probe' else 'overrides'} | status | " + " | ".join(metrics) + " |",
             "|---|---|---|" + "---|" * len(metrics)]
    for row in rows:
        st = ", ".join(f"{k} {n}" for k, n in row["statuses"].items()) or "not run"
        lines.append(f"| {row['label']} | `{row['overrides']}` | {st} | " +
                     " | ".join(mean_sd(row[m]) for m in metrics) + " |")
    if any(m.startswith("end.") for m in metrics):
        lines += ["", "end.<series>: the logged training series averaged over the run's last tenth of steps "
                  "(train_nll: the per-token NLL of the training batches, with the run's own dropout, LayerDrop "
                  "or DropHead on); beside valid_nll it tells an undertrained arm (both high) from an "
                  "overfitted one (train low, valid high)."]
    lines += ["", f"Per seed ({metrics[0]}):", ""]
    for row in rows:
        per = ", ".join(f"s{s}: {fmt(v)} ({st})" for s, (v, st) in sorted(row["per_seed"].items())) or "not run"
        lines.append(f"- {row['label']}: {per}")
    return lines + [""]


def _reproduce_lines(study: Study, command: str) -> list[str]:
    """The Reproduce section: the study's command, what one run is, and the papers' own size (GPU)
    where the study file gives it."""
    lines = ["## Reproduce", "", "```bash", command, "```", ""]
    if study.kind == "train":
        lines.append("Each run is `python train.py " + " ".join(study.common) + " <the arm's overrides> seed=<s>` "
                     "(run folders under `studies/runs/`, named by their identity; the records the tables "
                     "are computed from are under `runs/` here).")
    else:
        lines.append("The records the tables are computed from are under `runs/` here.")
    if study.paper_preset:
        p = study.paper_preset
        lines += ["", "## At the papers' size (GPU)", "", "```bash", str(p.get("command", "")).strip(), "```", "",
                  str(p.get("cost", "")).strip()]
    return lines


def _plots(study: Study, by_arm: dict[str, list[Record]], out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for i, arm in enumerate(study.arms.values()):
        for j, r in enumerate(by_arm.get(arm.name, [])):
            pts = r.curve(study.curves)
            if pts:
                ax.plot(*zip(*pts), color=f"C{i % 10}", alpha=0.8, label=arm.label if j == 0 else None,
                        linestyle="-" if r.status == "completed" else ":")
                drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel(study.curves.replace("_", " "))
        ax.set_title(f"{study.name}: {study.curves} (one line per seed; dotted: not completed)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "curves.png", dpi=90)
        made.append((f"{study.curves} by step", "curves.png"))
    plt.close(fig)
    metric = study.table_metrics[0]
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(study.arms)))
    for i, arm in enumerate(study.arms.values()):
        vals = [r.metric(metric) for r in by_arm.get(arm.name, []) if r.metric(metric) is not None]
        if vals:
            ax.scatter(vals, [i] * len(vals), color=f"C{i % 10}", zorder=3)
            ax.plot([np.mean(vals)] * 2, [i - 0.3, i + 0.3], color="k")
    ax.set_yticks(range(len(study.arms)), [a.label for a in study.arms.values()], fontsize=8)
    ax.set_xlabel(f"{metric} (dots: seeds; bar: mean)")
    fig.tight_layout()
    fig.savefig(out / f"{metric}.png", dpi=90)
    plt.close(fig)
    made.append((f"{metric} per arm", f"{metric}.png"))
    return made


def _shared(cost: dict) -> str:
    """Runs recorded by another study with the same identity (runner.adopt_shared): trained once,
    their machine-hours counted in that study."""
    if not cost.get("shared"):
        return ""
    return (f"; {cost['shared']} of the runs shared with {', '.join(cost['shared_with'])} (the same runs, trained "
            "once; their CPU-hours are counted there)")


def _extra_seeds(study: Study) -> str:
    """`; seed 3 of admin and pre_ln only`: the arms that run seeds beyond the study's."""
    extra = {}
    for arm in study.arms.values():
        for s in sorted(set(study.seeds_of(arm)) - set(study.seeds)):
            extra.setdefault(s, []).append(arm.name)
    return "".join(f"; seed {s} of {', '.join(arms)} only" for s, arms in extra.items())


def _unfinished(study: Study, cost: dict) -> str:
    """`; 9 of 14 planned runs recorded`: a study that is part way (a seed of some arms only) says
    so beside its seeds; the same command continues it."""
    planned = study.planned
    if study.kind == "probe" or cost["runs"] >= planned:
        return ""
    return f"; {cost['runs']} of {planned} planned runs recorded, the same command continues"
