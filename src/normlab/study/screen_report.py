"""The study README's Screens section: each screened arm's settings, their validation values at every
rung, where each was dropped and the setting chosen (study/screen.py), and the learning-rate
sensitivity plot: the last value each setting reached against its learning rate, one line per
other setting, one panel per arm (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities", Fig. 1). Only validation values: test scores choose nothing.
"""
from __future__ import annotations

import math
from pathlib import Path

from normlab.study.damaged import read_results
from normlab.study.screen import read_choice, setting_name
from normlab.study.spec import Study


def screen_data(study: Study, out: Path) -> dict[str, dict]:
    """{arm: its <out>/screen/<arm>.json} for the screened arms that have one."""
    if study.screen is None:
        return {}
    found, grid = {}, [setting_name(s) for s in study.screen.settings()]
    for arm in study.arms.values():  # on today's grid only, as screen_run.choices takes it
        data = read_choice(out / "screen" / f"{arm.name}.json", grid) if study.screened(arm) else None
        if data:
            found[arm.name] = data
    return found


def steps_trained(data: dict) -> int:
    """The steps a screen trained beyond the chosen setting's own run (which is the arm's first seed):
    every other setting to the rung it left at (at most: one that diverged or stalled stopped sooner)."""
    return sum(row["dropped_at"] or data["rungs"][-1] for row in data["settings"] if row["name"] != data["chosen"])


def screen_cpu(study: Study, out: Path, arm: str) -> dict:
    """The CPU time of an arm's screen (issue 36), from its rung records (<out>/screen/<arm>/<setting>/,
    screen_run.py: each setting's run at the last rung it reached): `cpu_s`, over all the run's legs
    (a run continued from its checkpoint carries the earlier legs' count: callbacks/full_checkpoint.py).
    {"hours": {setting: CPU-hours} of the runs this study trained, "shared": {setting: the study that
    trained it} (a record copied from another study's, marked `shared_from`: counted there), "missing":
    the settings with no rung record or none with `cpu_s` (not recorded: not guessed), "chosen": the
    chosen setting, "in_seed": whether the arm's seed record holds the chosen setting's run (the same
    identity, and its legs continue the rung record's (`continued`): the run continued as that seed,
    whose `cpu_s` counts the screen's steps; counted once)}."""
    chosen = (read_choice(out / "screen" / f"{arm}.json") or {}).get("chosen")
    hours, shared, missing, ident, legs = {}, {}, [], {}, {}
    for name in (setting_name(x) for x in study.screen.settings()):
        res = read_results(out / "screen" / arm / name / "results.json", record=True, seed=False) or {}
        cpu, ident[name], legs[name] = res.get("cpu_s"), res.get("identity_hash"), res
        if isinstance(res.get("shared_from"), dict):
            shared[name] = str(res["shared_from"].get("study", "?"))  # a damaged field: shown, not a traceback
        elif isinstance(cpu, (int, float)) and not isinstance(cpu, bool) and math.isfinite(cpu):
            hours[name] = float(cpu) / 3600
        else:
            missing.append(name)
    seed = read_results(out / "runs" / f"{arm}-s{study.screen.seed}" / "results.json", record=True) or {}
    in_seed = (chosen is not None and ident.get(chosen) is not None and seed.get("identity_hash") == ident[chosen]
               and continued(legs.get(chosen), seed))
    return {"hours": hours, "shared": shared, "missing": missing, "chosen": chosen, "in_seed": in_seed}


def continued(rung: dict | None, seed: dict) -> bool:
    """Whether the seed record's run continued the screen's run of its rung record (so the seed's
    cpu_s, summed over its legs, holds the screen's steps): the rung record's code legs begin the
    seed's, and the seed's next leg starts where the record stopped. A seed trained again from step 0
    (a fresh clone: the screen's checkpoint not committed) has no leg from there, so the screen's run
    is counted in the screen. Records from before code_legs: the same identity is taken as continued."""
    mine, theirs = (rung or {}).get("code_legs"), seed.get("code_legs")
    if not isinstance(mine, list) or not isinstance(theirs, list):
        return True
    n = len(mine)
    return (theirs[:n] == mine and len(theirs) > n and isinstance(theirs[n], dict)
            and theirs[n].get("from_step") == (rung or {}).get("steps"))


def _cpu_text(c: dict, seed: int) -> str:
    """The arm's screen in CPU time, for its line in the Screens section (screen_cpu)."""
    parts = []
    if c["hours"]:
        beyond = sum(h for n, h in c["hours"].items() if n != c["chosen"])
        parts.append(f"its settings' runs used {sum(c['hours'].values()):.2f} CPU-hours to where each left "
                     f"({len(c['hours'])} runs; {beyond:.2f} beyond the chosen run"
                     + (f", whose seed {seed} record counts it whole" if c["in_seed"] else "") + ")")
    if c["missing"]:
        parts.append(f"CPU time not recorded for {', '.join(c['missing'])} (no rung record with `cpu_s`)")
    if c["shared"]:
        parts.append(f"{len(c['shared'])} settings' runs shared with {', '.join(sorted(set(c['shared'].values())))} "
                     "(the same runs, trained once; their CPU-hours are counted there)")
    return "".join(f"; {p}" for p in parts)


def screens_cost(study: Study, out: Path) -> str:
    """The Cost line's clause for the screens: the CPU-hours of every screened arm's settings' runs
    beyond what the seed records count (a chosen run continued as a seed is counted there, once),
    from the rung records; "not recorded" for those without `cpu_s` (or no rung record: a screen from
    before rung records, or not run yet). Empty for a study with no screen."""
    if study.screen is None:
        return ""
    arms = [screen_cpu(study, out, a.name) for a in study.arms.values() if study.screened(a)]
    hours = sum(h for c in arms for n, h in c["hours"].items() if not (c["in_seed"] and n == c["chosen"]))
    missing, shared = sum(len(c["missing"]) for c in arms), sum(len(c["shared"]) for c in arms)
    runs = sum(len(c["hours"]) for c in arms) + missing + shared
    if missing == runs:
        return "; the screens: CPU time not recorded (no rung record with `cpu_s`)"
    return (f"; the screens: {hours:.2f} CPU-hours more (the settings' runs to where each left, from their rung "
            "records; a chosen run continued as a seed counted once, in its seed's record"
            + (f"; not recorded for {missing} of {runs} settings' runs" if missing else "")
            + (f"; {shared} shared with another study, counted there" if shared else "") + ")")


def screen_lines(study: Study, out: Path, budget_steps: int | None) -> list[str]:
    data = screen_data(study, out)
    if not data:
        return []
    s = study.screen
    grid = ", ".join(f"`{k}` in {list(v)}" for k, v in s.grid)
    lines = ["## Screens (each arm's setting, chosen on validation)", "",
             f"Every screened arm trained each setting of {grid} on seed {s.seed} to step {s.rungs[0]}; at each "
             f"rung ({', '.join(map(str, s.rungs))}) the best {s.keep:g} by {s.by} went on from its checkpoint, "
             "and after the last rung the best one is the arm's setting: its run, continued, is the arm's seed "
             f"{s.seed}, and the other seeds run at it. A setting that diverged or stalled left at its rung. "
             "Test scores choose nothing.", ""]
    for arm, d in data.items():
        extra = steps_trained(d)
        cost = f"; the screen trained {extra:,} steps beyond the chosen run" + (
            f" ({extra / budget_steps:.2f} runs of {budget_steps:,} steps)" if budget_steps else "") + _cpu_text(
            screen_cpu(study, out, arm), s.seed)
        label = study.arms[arm].label
        lines += [f"**{label}**: chosen `{' '.join(_chosen(d))}`{cost}.", "",
                  "| setting | " + " | ".join(f"{s.by} at {r}" for r in d["rungs"]) + " | left at |",
                  "|---|" + "---|" * len(d["rungs"]) + "---|"]
        for row in d["settings"]:
            cells = [_fmt(row["values"].get(str(r))) for r in d["rungs"]]
            left = ("chosen" if row["name"] == d["chosen"] else
                    f"{row['dropped_at']}" + (f" ({row['status']})" if row["status"] not in ("stopped", "completed") else ""))
            name = f"**{row['name']}**" if row["name"] == d["chosen"] else row["name"]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {left} |")
        lines.append("")
    plot = _plot(study, data, out)
    if plot:
        lines += [f"![{s.by} against the learning rate, per arm]({plot})", ""]
    return lines


def _chosen(d: dict) -> list[str]:
    return next(row["overrides"] for row in d["settings"] if row["name"] == d["chosen"])


def _fmt(v) -> str:
    return "—" if v is None else f"{v:.3f}"


def _plot(study: Study, data: dict[str, dict], out: Path) -> str | None:
    """screen.png: the last value each setting reached against optim.lr (log scale), a line per value
    of the other grid keys, a panel per arm; None when the grid has no optim.lr."""
    keys = [k for k, _ in study.screen.grid]
    if "optim.lr" not in keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(data))
    rows = math.ceil(len(data) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False, sharey=True)
    for ax, (arm, d) in zip(axes.flat, data.items()):
        lines: dict[str, list[tuple[float, float]]] = {}
        for row in d["settings"]:
            setting = dict(o.split("=", 1) for o in row["overrides"])
            reached = [(int(r), v) for r, v in row["values"].items() if v is not None]
            if not reached:
                continue
            other = " ".join(f"{k.rsplit('.', 1)[-1]} {setting[k]}" for k in keys if k != "optim.lr")
            lines.setdefault(other, []).append((float(setting["optim.lr"]), max(reached)[1]))
        for i, (other, pts) in enumerate(sorted(lines.items())):
            ax.plot(*zip(*sorted(pts)), marker="o", color=f"C{i}", label=other or None)
        ax.set_xscale("log")
        ax.set_title(study.arms[arm].label, fontsize=9)
        ax.set_xlabel("learning rate", fontsize=8)
        if lines and any(lines):
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    axes[0][0].set_ylabel(f"{study.screen.by} where it left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "screen.png", dpi=90)
    plt.close(fig)
    return "screen.png"
