"""Run a study's screens (study/screen.py): every screened arm's settings rung by rung, all arms
together so that `--jobs` runs stay busy, then the choice of each arm's setting.

A rung's jobs are ordinary study runs (runner.Sweep) told to pause at the rung
(`callbacks.preemption.stop_at_step`); a run already at or past the rung, or finished (diverged or
stalled: dropped), trains nothing. So the screen continues after SIGTERM like the rest of a study,
and a second run of the command finds the choices made (<out>/screen/<arm>.json) and goes on.
"""
from __future__ import annotations

from pathlib import Path

from normlab.outcome import FINISHED
from normlab.study.plan import Job, compose, make_job
from normlab.study.runner import Sweep, run_results
from normlab.study.screen import (check_rungs, ranked_value, read_choice, setting_name, setting_overrides, survivors,
                                   write_choice)
from normlab.study.spec import Arm, Study


class RungSweep(Sweep):
    """A Sweep whose jobs pause at their rung: a run paused there counts as trained, and no record is
    written (the screen's choice file is its record)."""

    def _trained(self, job: Job, res: dict) -> bool:
        return res.get("status") in FINISHED or (res.get("status") == "stopped" and int(res.get("steps") or 0) >= job.stop_at)

    def _next(self, job: Job) -> None:
        res = run_results(job) or {}
        if not self._trained(job, res):
            self._start(job, "train", self._train_command(job))
            self.say(f"start {job.tag} (screen {Path(job.record).name}, to step {job.stop_at}): {job.run_dir}")
            return
        self.recorded += 1
        self.say(f"rung  {job.tag} ({Path(job.record).name}) at step {job.stop_at}: status {res.get('status')} "
                 f"({self._progress()})")


def screen_jobs(study: Study, arm: Arm, runs: Path, out: Path, names: list[str], rung: int) -> dict[str, Job]:
    """{setting name: its run on the screen's seed, paused at `rung`}."""
    settings = {setting_name(s): s for s in study.screen.settings()}
    return {name: make_job(study, arm, study.screen.seed,
                           study.arm_overrides(arm, study.screen.seed) + setting_overrides(settings[name]), runs,
                           out / "screen" / arm.name / name, stop_at=rung) for name in names}


def choices(study: Study, out: Path) -> dict[str, list[str]]:
    """{arm: the overrides of its chosen setting} for every screened arm whose screen is decided on
    today's grid (a choice made on another grid is not taken)."""
    if study.screen is None:
        return {}
    settings = {setting_name(s): s for s in study.screen.settings()}
    found = {}
    for arm in study.arms.values():
        data = read_choice(out / "screen" / f"{arm.name}.json") if study.screened(arm) else None
        if data and data["chosen"] in settings and [r["name"] for r in data["settings"]] == list(settings):
            found[arm.name] = setting_overrides(settings[data["chosen"]])
    return found


def run_screens(study: Study, runs: Path, out: Path, parallel: int = 1, launch: list[str] = ()) -> int:
    """Screen every screened arm without a choice; 0 when all are decided, 128+signal when stopped."""
    screen = study.screen
    arms = [a for a in study.arms.values() if study.screened(a) and a.name not in choices(study, out)]
    if not arms:
        return 0
    cfg = compose(study.arm_overrides(arms[0], screen.seed))  # the budget's steps and validation interval
    check_rungs(screen, int(cfg.trainer.max_steps), cfg.trainer.val_check_interval)
    names = [setting_name(s) for s in screen.settings()]
    rows = {a.name: {n: {"name": n, "overrides": setting_overrides(s), "values": {}, "status": None, "dropped_at": None}
                     for n, s in zip(names, screen.settings())} for a in arms}
    alive = {a.name: list(names) for a in arms}
    for i, rung in enumerate(screen.rungs):
        jobs = {a.name: screen_jobs(study, a, runs, out, alive[a.name], rung) for a in arms}
        sweep = RungSweep(study, [j for js in jobs.values() for j in js.values()], runs, parallel, launch)
        code = sweep.run()
        if code:
            return code
        if sweep.failed or sweep.refused:  # a crash or a damaged results.json is not a result: retried next time
            return 1
        for arm in arms:
            alive[arm.name] = _rung(screen, i, rung, jobs[arm.name], rows[arm.name])
    for arm in arms:  # one left after the last rung (screen.kept), or none if every setting failed
        chosen = alive[arm.name][0] if alive[arm.name] else None
        write_choice(out / "screen" / f"{arm.name}.json", arm.name, screen, list(rows[arm.name].values()), chosen)
    return 0


def _rung(screen, i: int, rung: int, jobs: dict[str, Job], rows: dict[str, dict]) -> list[str]:
    """Rank the settings that reached the rung; return those that go on, mark the others dropped."""
    values = {}
    for name, job in jobs.items():
        res = run_results(job) or {}
        rows[name]["status"] = res.get("status")
        rows[name]["floor"] = res.get("input_independent_loss")  # L*: a value at it is a stall the guard had no time to see
        if res.get("status") == "completed" or res.get("status") == "stopped":
            values[name] = ranked_value(job.run_dir, rung, screen.by, res.get("status"))
        else:  # diverged or stalled before the rung: out
            values[name] = None
        rows[name]["values"][str(rung)] = values[name]
    kept = survivors(screen, i, values)
    for name in jobs:
        if name not in kept:
            rows[name]["dropped_at"] = rung
    return kept
