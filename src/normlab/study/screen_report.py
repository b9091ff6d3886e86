"""The study README's Screens section: each screened arm's settings, their validation values at every
rung, where each was dropped and the setting chosen (study/screen.py), and the learning-rate
sensitivity plot: the last value each setting reached against its learning rate, one line per
other setting, one panel per arm (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities", Fig. 1). Only validation values: test scores choose nothing.
"""
from __future__ import annotations

import math
from pathlib import Path

from normlab.study.cpu_ledger import legs_continue, own_names, spent
from normlab.study.damaged import read_results
from normlab.study.screen import read_choice, setting_name, setting_overrides
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
    screen_run.py: each setting's run at the last rung it reached) of today's runs (the identity
    hash each setting's job has now): what this study's machines spent on each setting (cpu_ledger:
    the run's `cpu_s` over all its legs, plus earlier runs of it trained again from step 0, less the
    steps another study trained and counts). {"hours": {setting: CPU-hours}, "redone": {setting: the
    part spent on runs trained again since}, "shared": {setting: the study that trained it} (a record
    copied from another study's, marked `shared_from`: counted there), "continued_from": {setting: the
    study whose run this one continued} (those steps counted there), "other": the settings whose record
    holds another identity's run (a changed grid or arm: not this screen's, not counted), "missing":
    the settings with no rung record or none with `cpu_s` (not recorded: not guessed), "chosen": the
    chosen setting, "in_seed": whether the arm's seed record holds the chosen setting's run (the same
    identity, and its legs continue the rung record's (`continued`): the run continued as that seed,
    whose `cpu_s` counts the run's steps; counted once)}."""
    grid = [setting_name(x) for x in study.screen.settings()]  # a choice on another grid is not this screen's
    chosen = (read_choice(out / "screen" / f"{arm}.json", grid) or {}).get("chosen")
    today, mine = identities(study, arm, out), own_names(study.name, out, study.formerly)
    c = {"hours": {}, "redone": {}, "shared": {}, "continued_from": {}, "other": [], "missing": [], "chosen": chosen}
    held = {}
    for name, ident in today.items():
        res = read_results(out / "screen" / arm / name / "results.json", record=True, seed=False) or {}
        if res and res.get("identity_hash") != ident:
            c["other"].append(name)
            continue
        held[name] = res
        _count(c, name, res, study.name, mine)
    seed = read_results(out / "runs" / f"{arm}-s{study.screen.seed}" / "results.json", record=True) or {}
    c["in_seed"] = (chosen in held and seed.get("identity_hash") == today[chosen]
                    and continued(held[chosen], seed))
    return c


def _count(c: dict, name: str, res: dict, own: str, mine: set[str]) -> None:
    """One setting's rung record into screen_cpu's answer."""
    if isinstance(res.get("shared_from"), dict):
        c["shared"][name] = str(res["shared_from"].get("study", "?"))  # a damaged field: shown, not a traceback
    entries = spent(res, own) if res else None
    if entries is None:
        if name not in c["shared"]:
            c["missing"].append(name)
        return
    others = sorted({str(e.get("study")) for e in entries if e.get("study") not in mine and not e.get("redone")})
    if others and name not in c["shared"]:
        c["continued_from"][name] = ", ".join(others)
    ours = [e for e in entries if e.get("study") in mine]
    if ours or name not in c["shared"]:
        c["hours"][name] = sum(e["cpu_s"] for e in ours) / 3600
        c["redone"][name] = sum(e["cpu_s"] for e in ours if e.get("redone")) / 3600


_IDENTITIES: dict[tuple, str] = {}  # composed once a command: the README reads each arm's screen twice


def identities(study: Study, arm: str, out: Path) -> dict[str, str]:
    """{setting: the identity hash of its run today} (screen_run.screen_jobs, composed as the screen
    composes it), which a rung record must hold to count."""
    from normlab.study.screen_run import screen_jobs  # the runner's modules only where a screen is read

    names = [setting_name(x) for x in study.screen.settings()]
    key = (study.name, study.budget, arm, tuple(study.arm_overrides(study.arms[arm], study.screen.seed)),
           tuple(tuple(setting_overrides(x)) for x in study.screen.settings()))
    if key not in _IDENTITIES:
        jobs = screen_jobs(study, study.arms[arm], out / ".no-runs", out, names, study.screen.rungs[0])
        _IDENTITIES[key] = {n: j.identity_hash for n, j in jobs.items()}
    return dict(_IDENTITIES[key])


def continued(rung: dict | None, seed: dict) -> bool:
    """Whether the seed record's run continued the screen's run of its rung record (so the seed's
    cpu_s, summed over its legs, holds the screen's steps): the rung record's code legs begin the
    seed's, and the seed's next leg starts where the record stopped. A seed trained again from step 0
    (a fresh clone: the screen's checkpoint not committed) has no leg from there, so the screen's run
    is counted in the screen. Records from before code_legs: the same identity is taken as continued."""
    went_on = legs_continue(rung or {}, seed)
    return True if went_on is None else went_on


def counted(c: dict) -> float:
    """The CPU-hours of an arm's screen beyond its seed record: all its settings' but the chosen run's
    own where the seed counts it (its runs trained again from step 0 are in no seed: counted here)."""
    seeded = c["hours"].get(c["chosen"], 0.0) - c["redone"].get(c["chosen"], 0.0) if c["in_seed"] else 0.0
    return sum(c["hours"].values()) - seeded


def _cpu_text(c: dict, seed: int) -> str:
    """The arm's screen in CPU time, for its line in the Screens section (screen_cpu)."""
    parts = []
    if c["hours"]:
        beyond = sum(h for n, h in c["hours"].items() if n != c["chosen"]) + c["redone"].get(c["chosen"], 0.0)
        redone = sum(c["redone"].values())
        parts.append(f"its settings' runs used {sum(c['hours'].values()):.2f} CPU-hours to where each left "
                     f"({len(c['hours'])} runs; {beyond:.2f} beyond the chosen run"
                     + (f", whose seed {seed} record counts it whole" if c["in_seed"] else "")
                     + (f"; {redone:.2f} on runs trained again from step 0 since (work redone, spent all the same)"
                        if redone else "") + ")")
    if c["missing"]:
        parts.append(f"CPU time not recorded for {', '.join(c['missing'])} (no rung record with `cpu_s`)")
    if c["shared"]:
        parts.append(f"{len(c['shared'])} settings' runs shared with {', '.join(sorted(set(c['shared'].values())))} "
                     "(the same runs, trained once; their CPU-hours are counted there)")
    if c["continued_from"]:
        parts.append(f"{len(c['continued_from'])} settings' runs continued from "
                     f"{', '.join(sorted(set(c['continued_from'].values())))}'s (the steps before counted there)")
    if c["other"]:
        parts.append(f"the rung records of {', '.join(c['other'])} hold another identity's run (a changed grid or "
                     "arm): not this screen's, their CPU time not counted")
    return "".join(f"; {p}" for p in parts)


def screens_total(study: Study, out: Path) -> dict:
    """Every screened arm's screen_cpu summed (the Cost line, claims.json's `cost.screens`): "hours"
    beyond the seed records (`counted`), the settings' runs with a record of today's identity ("runs"),
    of them "missing" (no `cpu_s`) and "shared" (counted in another study), and "other" (records of
    another identity, not counted)."""
    arms = [screen_cpu(study, out, a.name) for a in study.arms.values() if study.screened(a)]
    runs = sum(len(set(c["hours"]) | set(c["missing"]) | set(c["shared"])) for c in arms)
    return {"hours": sum(counted(c) for c in arms), "runs": runs, "missing": sum(len(c["missing"]) for c in arms),
            "shared": sum(len(c["shared"]) for c in arms), "other": sum(len(c["other"]) for c in arms),
            "redone": sum(h for c in arms for h in c["redone"].values())}


def screens_cost(study: Study, out: Path) -> str:
    """The Cost line's clause for the screens: the CPU-hours of every screened arm's settings' runs
    beyond what the seed records count (a chosen run continued as a seed is counted there, once),
    from the rung records, work redone included; "not recorded" for those without `cpu_s` (or no rung
    record: a screen from before rung records, or not run yet). Empty for a study with no screen."""
    if study.screen is None:
        return ""
    t = screens_total(study, out)
    other = (f"; {t['other']} rung record{'s' if t['other'] > 1 else ''} of another identity (a changed grid or "
             "arm) not counted" if t["other"] else "")
    if t["missing"] == t["runs"]:
        return "; the screens: CPU time not recorded (no rung record with `cpu_s`)" + other
    return (f"; the screens: {t['hours']:.2f} CPU-hours more (the settings' runs to where each left, from their rung "
            "records; a chosen run continued as a seed counted once, in its seed's record"
            + (f"; {t['redone']:.2f} of them on runs trained again from step 0 (work redone)" if t["redone"] else "")
            + (f"; not recorded for {t['missing']} of {t['runs']} settings' runs" if t["missing"] else "")
            + (f"; {t['shared']} shared with another study, counted there" if t["shared"] else "") + other + ")")


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
