"""`normlab-study NAME --status` for a screened study (study/screen.py): each screened arm's screen,
setting by setting, the seeds that wait for it, and the training steps and CPU-hours left, read from
the run folders and records without running, copying or writing anything.

    deep_bleu (full): 7 screened arms x 8 settings (optim.lr x optim.warmup, by valid_loss at steps 500,
      1000): 0 decided; settings: 2 kept, 6 left, 2 training now, 46 not started; 21 seed runs: 21 wait ...
    screen post_ln, at rung 1000: 2 kept, 6 left
      lr0.0005-warmup150   kept at rung 500 (valid_loss 6.441): goes on to rung 1000
      lr0.0005-warmup1000  left at rung 500: valid_loss 6.498
      lr0.001-warmup150    stalled at step 500: left at rung 500
      ...
      seeds 1, 2, 3        wait for the screen (seed 1 continues the chosen setting's run from step 1000)
    screen pre_ln, at rung 500: 2 training now, 6 not started
      lr0.0005-warmup150   training now: step 275, to rung 500
    ...
    left: about 24.97 CPU-hours (12.49 hours of this machine's 2 cores): 107,500 training steps (...)

A screen that has no choice file (<out>/screen/<arm>.json) is replayed as the study would run it
(screen_run.run_screens): every setting that reached a rung is ranked there by the same rule
(screen.survivors), the others are shown where they are (at the rung, stalled or diverged, training
now, stopped part-way with the checkpoint the study continues, failed, damaged, not started). A
setting whose run folder is gone (a fresh clone) is where its rung record (<out>/screen/<arm>/<setting>/,
screen_run.py) says, when that holds today's run: at the rung it reached, or ended there; with no such
record of its own, where another study's rung record of the same run says (screen_run.rung_index, read
once: the full budget's records, as the run itself takes them). A screen
whose every rung is ranked has its setting: its seeds are planned (plan.plan) and shown as any run
of the study (status.job_state), seed 1 being the chosen setting's run, continued.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from normlab.outcome import FINISHED
from normlab.study.damaged import is_damaged
from normlab.study.plan import Job, plan
from normlab.study.runner import record_done, run_results, shared_index
from normlab.study.screen import Screen, ranked_value, read_choice, rung_value, setting_name, setting_overrides, survivors
from normlab.study.screen_run import choices, rung_index, rung_results, screen_jobs
from normlab.study.spec import Arm, Study
from normlab.study.status import job_state, log_progress


@dataclass
class Setting:
    name: str
    state: str  # at rung | left | stalled | diverged | completed | chosen | training now | stopped part-way | ...
    text: str
    done: int  # steps trained that the study keeps (its checkpoint, or where it paused or ended)
    res: dict = field(default_factory=dict)  # its run folder's results.json
    value: float | None = None  # its validation value at the rung it reached
    folder: str = ""  # its run folder's name (a run two rows show is counted once)

    @property
    def trained(self) -> bool:  # reached the rung, or ended (a run that diverged or stalled is out)
        return self.state in ("at rung", *FINISHED)


@dataclass
class ArmScreen:
    arm: Arm
    settings: list[Setting]
    rung: int | None  # the rung it works toward; None: every rung ranked
    chosen: Setting | None  # every rung ranked: the chosen setting (None if every setting failed)
    left: int  # the screen's training steps left, every setting still in it to its rung (an upper bound)


def setting_state(job: Job, rung: int, by: str, shared: dict[str, Path] | None = None) -> Setting:
    """Where one setting's run is with respect to `rung`: its run folder, or where that is gone (a
    fresh clone), its rung record of today's identity that reached the rung, else another study's of
    the same run (`shared`: screen_run.rung_index; screen_run.rung_results)."""
    s = _state(job, rung, by, shared)
    s.folder = job.run_dir.name
    return s


def _state(job: Job, rung: int, by: str, shared: dict[str, Path] | None) -> Setting:
    from normlab.run_folder import held_elsewhere

    name = job.record.name
    if is_damaged(job.run_dir / "results.json", record=False):  # named in a warning (study/damaged.py)
        return Setting(name, "damaged", "its run folder's results.json is damaged (see its warning): not run while "
                       "it is there", 0)
    if is_damaged(job.record / "results.json", record=True):  # its rung record: the study refuses it too (runner.damaged_job)
        return Setting(name, "damaged", "its rung record's results.json is damaged (see its warning): not run while "
                       "it is there", 0)
    res, metrics = rung_results(job, rung, shared)
    status, steps = res.get("status"), int(res.get("steps") or 0)
    if status in FINISHED:  # a completed run (e.g. another study's, trained to its cap) is ranked by its value
        value = ranked_value(metrics, rung, by, status) if status == "completed" else None  # as screen_run ranks it
        return Setting(name, status, f"{status} at step {steps}", steps, res, value)
    if status == "stopped" and steps >= rung:  # paused at the rung (or past it, continuing)
        s = Setting(name, "at rung", "", steps, res, rung_value(metrics, rung, by))
        s.text = f"at rung {rung}: {_value(s, by)}"
        return s
    ckpt, last, _, _ = log_progress(job.run_dir)
    done = max(ckpt, steps if status == "stopped" else 0)
    if held_elsewhere(job.run_dir):
        return Setting(name, "training now", f"training now: step {last if last is not None else done}, to rung {rung}",
                       max(done, last or 0), res)
    if status == "failed":
        error = str(res.get("error") or "no error recorded").strip().splitlines()[-1][:160]
        return Setting(name, "failed", f"failed ({error}); the study runs it again", done, res)
    if done:
        return Setting(name, "stopped part-way", f"stopped part-way: its step-{done} checkpoint, to rung {rung}; the "
                       "study continues it", done, res)
    if job.run_dir.is_dir():
        return Setting(name, "not started", "started, no checkpoint yet: starts over", 0, res)
    return Setting(name, "not started", "not started", 0, res)


def _later(screen: Screen, i: int, n: int) -> int:
    """The steps of the rungs after rung i, for the settings that go on from n at rung i."""
    steps = 0
    for j in range(i + 1, len(screen.rungs)):
        n = screen.kept(n, j - 1)
        steps += n * (screen.rungs[j] - screen.rungs[j - 1])
    return steps


def replay(study: Study, arm: Arm, jobs: dict[str, Job], shared: dict[str, Path] | None = None) -> ArmScreen:
    """The arm's screen as its run folders have it (or its rung records, or `shared`: other studies'
    of the same runs, screen_run.rung_index), ranked rung by rung as screen_run does."""
    screen = study.screen
    alive, shown, before = list(jobs), {}, {}
    for i, rung in enumerate(screen.rungs):
        states = {n: setting_state(jobs[n], rung, screen.by, shared) for n in alive}
        for n, s in states.items():  # kept at the rung before, paused there: it goes on when the study runs
            if n in before and s.state == "stopped part-way" and s.done <= screen.rungs[i - 1]:
                s.state, s.text = "kept", f"kept at rung {screen.rungs[i - 1]} ({before[n]}): goes on to rung {rung}"
            elif n in before and s.state == "not started" and not jobs[n].run_dir.is_dir():  # ranked from its record
                s.state, s.text = "kept", (f"kept at rung {screen.rungs[i - 1]} ({before[n]}): its run folder is gone, "
                                           f"trains again from step 0 to rung {rung}")
        if not all(s.trained for s in states.values()):  # the screen is at this rung
            shown.update(states)
            left = sum(max(0, rung - s.done) for s in states.values() if s.state not in FINISHED)
            return ArmScreen(arm, [shown[n] for n in jobs], rung, None, left + _later(screen, i, len(alive)))
        kept = survivors(screen, i, {n: s.value if s.state in ("at rung", "completed") else None
                                     for n, s in states.items()})
        for n, s in states.items():
            if n not in kept:
                s.text = (f"left at rung {rung}: {_value(s, screen.by)}" if s.state == "at rung"
                          else f"{s.text}: left at rung {rung}")
                s.state = "left"
            shown[n] = s
        before = {n: _value(states[n], screen.by) for n in kept}
        alive = kept
    chosen = shown[alive[0]] if alive else None  # after the last rung, one is kept (screen.kept)
    if chosen is not None:
        chosen.state = "chosen"
        chosen.text = f"chosen at rung {screen.rungs[-1]}: {_value(chosen, screen.by)}; its run is the arm's seed {screen.seed}"
    return ArmScreen(arm, [shown[n] for n in jobs], None, chosen, 0)


def _value(s: Setting, by: str) -> str:
    return f"{by} {s.value:.3f}" if s.value is not None else f"no {by} logged"


def _rate(results: list[dict]) -> tuple[float, int] | None:
    """(CPU seconds a training step, steps measured) over the runs' results (cpu_s, or the README's
    estimate for a record from before runs counted it: readme.run_cpu_hours)."""
    from normlab.study.readme import run_cpu_hours

    pairs = [(run_cpu_hours(r)[0] * 3600, int(r.get("steps") or 0)) for r in results]
    steps = sum(s for _, s in pairs if s > 0)
    return (sum(c for c, s in pairs if s > 0) / steps, steps) if steps else None


def screened_status_lines(study: Study, runs: Path, out: Path, records: Path | None) -> list[str]:
    """The screens, the seeds and the time left of a screened study (status.status_lines for the rest)."""
    from normlab.study.plan import compose

    screen, decided = study.screen, choices(study, out)
    settings = {setting_name(s): s for s in screen.settings()}
    screened = [a for a in study.arms.values() if study.screened(a)]
    cap = int(compose(study.arm_overrides(screened[0], screen.seed)).trainer.max_steps)
    rungs = rung_index(records)  # once: every study's rung records (None: this study's own only)
    replays = {a.name: replay(study, a, screen_jobs(study, a, runs, out, list(settings), screen.rungs[0]), rungs)
               for a in screened if a.name not in decided}
    chosen = {**decided, **{arm: setting_overrides(settings[r.chosen.name]) for arm, r in replays.items() if r.chosen}}
    jobs = plan(study, runs, out, chosen)  # the unscreened arms and the screened ones with a setting
    shared = shared_index(records) if records is not None else {}
    rows = [(job, *job_state(job, shared)) for job in jobs]
    failed = [a for a in screened if a.name in replays and replays[a.name].rung is None and a.name not in chosen]
    waiting = [a for a in screened if a.name not in chosen and a not in failed]  # failed: no seed runs, none left
    n_wait, n_failed = (sum(len(study.seeds_of(a)) for a in arms) for arms in (waiting, failed))
    grid = " x ".join(k for k, _ in screen.grid)
    states = _tally(s.state for r in replays.values() for s in r.settings)
    head = (f"{study.name} ({study.budget}): {len(screened)} screened arms x {len(settings)} settings ({grid}, by "
            f"{screen.by} at steps {', '.join(map(str, screen.rungs))}): {len(decided)} decided"
            + (f"; settings: {_counts(states)}" if states else "") + f"; {len(jobs) + n_wait + n_failed} seed runs: "
            + _counts({**_tally(state for _, state, _, _ in rows), "wait for their screens": n_wait,
                       "will not run (every setting of their screen failed)": n_failed}))
    width = max([len(n) for n in settings] + [len(j.tag) for j in jobs] + [12]) + 2
    lines = [head]
    for arm in screened:
        if arm.name in decided:
            lines.append(f"screen {arm.name}: decided: {(read_choice(out / 'screen' / f'{arm.name}.json') or {}).get('chosen')}")
            continue
        r = replays[arm.name]
        where = f"at rung {r.rung}" if r.rung is not None else "every rung ranked" + (
            "; the choice is written when the study next runs" if r.chosen else ": every setting failed, no seed runs")
        lines.append(f"screen {arm.name}, {where}: {_counts(_tally(s.state for s in r.settings))}")
        lines += [f"  {s.name:<{width}}{s.text}" for s in r.settings]
        if r.rung is not None:
            seeds = ", ".join(map(str, study.seeds_of(arm)))
            lines.append(f"  {'seeds ' + seeds:<{width}}wait for the screen (seed {screen.seed} continues the chosen "
                         f"setting's run from step {screen.rungs[-1]})")
    lines += [f"  {job.tag:<{width}}{text}" for job, _, text, _ in rows]
    lines.append(_left(study, cap, replays, waiting, rows))
    return lines


def _tally(states) -> dict[str, int]:
    out: dict[str, int] = {}
    for state in states:
        out[state] = out.get(state, 0) + 1
    return out


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {state}" for state, n in counts.items() if n)


def _left(study: Study, cap: int, replays: dict[str, ArmScreen], waiting: list[Arm], rows) -> str:
    """The training steps left (screens to their last rung, every seed to the cap) and their CPU-hours
    at each arm's CPU time a step so far (the arms not yet run at the mean of those that have)."""
    screen = study.screen
    steps: dict[str, float] = {}
    for name, r in replays.items():
        steps[name] = steps.get(name, 0) + r.left
    for arm in waiting:
        seeds = study.seeds_of(arm)
        steps[arm.name] = steps.get(arm.name, 0) + (cap - screen.rungs[-1]) * (screen.seed in seeds) + cap * len(
            [s for s in seeds if s != screen.seed])
    for job, _, _, frac in rows:
        steps[job.arm.name] = steps.get(job.arm.name, 0) + (1.0 - frac) * cap
    measured: dict[str, dict[str, dict]] = {}  # {arm: {run folder: its results}}: a run counted once
    for name, r in replays.items():
        measured.setdefault(name, {}).update({s.folder: s.res for s in r.settings if s.res and s.done})
    for job, _, _, _ in rows:
        res = record_done(job) or run_results(job) or {}
        if res.get("steps"):
            measured.setdefault(job.arm.name, {})[job.run_dir.name] = res
    rates = {arm: rate for arm, results in measured.items() if (rate := _rate(list(results.values())))}
    total = sum(steps.values())
    if not total:
        return "left: nothing: every screen is decided and every planned run is recorded or finished"
    what = (f"{total:,.0f} training steps (the screens to their last rung, every seed to the {cap:,}-step cap; fewer "
            "where a run reaches its plateau, stalls or diverges; each run's final scoring comes on top)")
    if not rates:
        return f"left: {what}; no estimate of their time (no run of this study has trained yet)"
    mean = sum(r for r, _ in rates.values()) / len(rates)
    cpu_h = sum(n * rates.get(arm, (mean, 0))[0] for arm, n in steps.items()) / 3600
    cores = os.cpu_count() or 1
    per_arm = ", ".join(f"{arm} {r:.2f} s" for arm, (r, _) in sorted(rates.items()))
    return (f"left: about {cpu_h:.2f} CPU-hours ({cpu_h / cores:.2f} hours of this machine's {cores} cores): {what}, "
            f"at each arm's CPU time a step so far ({per_arm}; the arms not yet run at their mean, {mean:.2f} s)")
