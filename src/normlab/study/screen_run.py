"""Run a study's screens (study/screen.py): every screened arm's settings rung by rung, all arms
together so that `--jobs` runs stay busy, then the choice of each arm's setting.

A rung's jobs are ordinary study runs (runner.Sweep) told to pause at the rung
(`callbacks.preemption.stop_at_step`); a run already at or past the rung, or finished (diverged or
stalled: dropped), trains nothing. So the screen continues after SIGTERM like the rest of a study,
and a second run of the command finds the choices made (<out>/screen/<arm>.json) and goes on.

What is where (runner.py's docstring for the rest of a study):
- run folders: <runs>/<run name> (checkpoints, logs; not committed): a kept setting continues from
  its checkpoint at the rung.
- rung records: <out>/screen/<arm>/<setting>/ (results.json: the run's results, its identity_hash
  and the rung; metrics.csv), written when the setting's run is found at its rung (RungSweep) and
  replaced at the next; committed, small (no checkpoint).
- the choice: <out>/screen/<arm>.json, once every rung of the arm is ranked.
On a fresh clone (the run folders gone) the screen continues from its rung records: a setting whose
record of today's identity reached the rung is ranked from the record's metrics.csv and trains
nothing; a setting kept at a rung trains again from step 0 to the next (its checkpoint was not
committed): the same seed and data order, but on another CPU kernel path another trajectory (a
float's rounding), so its next rung's value is not the one the first machine would have logged. A
record of another identity (a changed grid or arm), or one without its metrics.csv, is not read.
Two studies that screen the same arm at the same settings hold the same runs (deep_recent's pre-LN
and post-LN are deep_bleu's): a setting with no record of its own that reached the rung takes another
study's rung record of its identity hash that did (rung_index: <records>/<study>/screen/<arm>/<setting>/,
indexed once a command, as runner.shared_index indexes the seeds' records), is ranked from it and
trains nothing; RungSweep copies it into the study's own folder marked `shared_from` (as
runner.adopt_shared copies a seed's record), so the study's screen stands on its own records and its
README counts that run's CPU time in the study that trained it (screen_report.py). Each rung record
written from a run folder carries `cpu_spent` (cpu_ledger.py): which study's machine spent how much on
the setting, runs trained again from step 0 included, so each CPU second is counted once, where spent.
"""
from __future__ import annotations

from pathlib import Path

from normlab.errors import UserError
from normlab.outcome import FINISHED
from normlab.study.cpu_ledger import adopted, own_names
from normlab.study.damaged import read_results, warn
from normlab.study.plan import Job, compose, make_job
from normlab.study.record_swap import write_record_folder
from normlab.study.runner import Sweep, copy_record, run_results, write_record
from normlab.study.screen import (NOT_DECIDED, check_rungs, choice_problem, metrics_csv, ranked_value, read_choice,
                                   setting_name, setting_overrides, survivors, validated, write_choice)
from normlab.study.spec import Arm, Study


def at_rung(res: dict, rung: int) -> bool:
    """A run's results say it reached the rung: finished (diverged or stalled: out; completed: at its
    plateau), or paused at or past the rung."""
    return res.get("status") in FINISHED or (res.get("status") == "stopped" and int(res.get("steps") or 0) >= rung)


def rung_record(job: Job, rung: int) -> dict | None:
    """The setting's rung record when it holds today's run (the job's identity hash, as
    runner.record_done asks) at `rung` or past it; else None."""
    res = read_results(job.record / "results.json", record=True)  # None: none, or damaged (named)
    if res is None or res.get("identity_hash") != job.identity_hash or not at_rung(res, rung):
        return None
    return res if ranks(job.record, res, rung) else None


def ranks(record: Path, res: dict, rung: int, name: bool = True) -> bool:
    """A rung record can rank its setting at `rung`: it ended diverged or stalled (ranked out without a
    value), or its metrics.csv holds the validation it is ranked by (screen.validated). One without it
    (only results.json committed, or a metrics.csv cut off or emptied: named once) is no record: the
    setting trains again rather than be dropped as if it had diverged."""
    if res.get("status") not in ("stopped", "completed"):
        return True
    metrics = metrics_csv(record)
    if not metrics.is_file():
        return False
    if validated(metrics, rung, res.get("status")):
        return True
    if name:  # a rung record (a run folder's is ranked as it is: _rung)
        warn(metrics, f"no validation logged at step {rung} (cut off or damaged)",
             "its rung record is not read: the setting trains again")
    return False


def rung_index(records: Path | None) -> dict[str, Path]:
    """{identity hash: the rung record of that run furthest along} over every study's screens,
    <records>/<study>/screen/<arm>/<setting>/: read once a command (rung_results looks each job up in
    it). Left out: folders being written (`.`-named, write_record's temp folders) and copies marked
    `shared_from` (their source is there). Furthest: finished, else the most steps."""
    index: dict[str, Path] = {}
    reach: dict[str, tuple[bool, int]] = {}
    for path in sorted(records.glob("*/screen/*/*/results.json")) if records is not None and records.is_dir() else []:
        if any(part.startswith(".") for part in path.relative_to(records).parts[:-1]):
            continue
        res = read_results(path, record=True, seed=False)  # looked up by identity, not by seed
        if res is None or res.get("shared_from") or res.get("rung") is None:
            continue
        if not isinstance(res.get("identity_hash"), str) or not res["identity_hash"]:
            continue
        key = (res.get("status") in FINISHED, int(res.get("steps") or 0))
        if res["identity_hash"] not in index or key > reach[res["identity_hash"]]:
            index[res["identity_hash"]], reach[res["identity_hash"]] = path.parent, key
    return index


def shared_rung(job: Job, rung: int, index: dict[str, Path]) -> tuple[dict, Path] | None:
    """(results, folder) of another study's rung record of the job's run (rung_index) that reached
    `rung`, read again (a record replaced since the index was read is taken only if it still holds
    the run at the rung); else None."""
    src = index.get(job.identity_hash)
    if src is None or src == job.record:
        return None
    res = read_results(src / "results.json", record=True, seed=False)
    if res is None or res.get("identity_hash") != job.identity_hash or not at_rung(res, rung) or not ranks(src, res, rung):
        return None
    return res, src


def rung_results(job: Job, rung: int, shared: dict[str, Path] | None = None) -> tuple[dict, Path]:
    """(results, metrics.csv) of the setting's run with respect to `rung`: its run folder's while it
    has a results.json (unless its own or another study's rung record took the run further: a folder
    left behind on this machine), else its rung record's when that reached the rung (the run folder
    gone: a fresh clone), else another study's rung record of the same run that reached it (`shared`:
    rung_index), else ({}, the run folder's)."""
    res = run_results(job)
    if res is not None and (record := rung_record(job, rung)) is not None and _further(record, res):
        # a run folder left behind here while another machine took the run further (its record committed):
        # the record stands, and the folder neither replaces it nor trains again what it holds
        return record, metrics_csv(job.record)
    if res is not None and (found := shared_rung(job, rung, shared or {})) is not None and _further(found[0], res):
        return found[0], metrics_csv(found[1])  # the same, taken further by another study (RungSweep copies it)
    if res is None and not (job.run_dir / "results.json").is_file():
        record = rung_record(job, rung)
        if record is not None:
            return record, metrics_csv(job.record)
        found = shared_rung(job, rung, shared or {})
        if found is not None:
            return found[0], metrics_csv(found[1])
    return res or {}, metrics_csv(job.run_dir)


def adopt_rung(study: Study, job: Job, res: dict, src: Path) -> None:
    """Copy another study's rung record of the job's run (shared_rung) into the setting's own folder
    (whole, as runner.adopt_shared: record_swap), marked `shared_from` (that study and its record) and named
    as this study's; this study's CPU time on the run that the copy does not hold is kept in it
    (cpu_ledger.adopted)."""
    res = dict(res, study={**(res.get("study") or {}), "name": study.name, "arm": job.arm.name, "seed": job.seed,
                           "overrides": job.overrides},
               shared_from={"study": src.parents[2].name, "record": f"screen/{src.parent.name}/{src.name}"})
    mine = own_names(study.name, job.record.parents[2], study.formerly)
    res = adopted(res, read_results(job.record / "results.json", record=True), study.name, mine)
    write_record_folder(job.record, lambda tmp: copy_record(src, tmp, res))


class RungSweep(Sweep):
    """A Sweep whose jobs pause at their rung: a run paused there counts as trained, and its rung
    record is written (runner.write_record); a run whose folder is gone counts as trained when its
    rung record reached the rung, or another study's of the same run (`shared`: rung_index), which it
    copies into its own (adopt_rung)."""

    def __init__(self, *args, shared: dict[str, Path] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared = shared or {}

    def _trained(self, job: Job, res: dict) -> bool:
        return at_rung(res, job.stop_at)

    def _next(self, job: Job) -> None:
        res, _ = rung_results(job, job.stop_at, self.shared)
        if not self._trained(job, res):
            # no run folder (a fresh clone: the setting was kept at the rung before, its checkpoint not
            # committed): train.py starts it from step 0, the same seed and data order (on another CPU, another
            # trajectory: module docstring)
            self._start(job, "train", self._train_command(job))
            self.say(f"start {job.tag} (screen {Path(job.record).name}, to step {job.stop_at}): {job.run_dir}")
            return
        folder, own = run_results(job), rung_record(job, job.stop_at)
        if not (folder is not None and own is not None and _further(own, folder)):  # else own record stands
            self._record(job, res, folder)
        self.recorded += 1
        self.say(f"rung  {job.tag} ({Path(job.record).name}) at step {job.stop_at}: status {res.get('status')} "
                 f"({self._progress()})")

    def _record(self, job: Job, res: dict, folder: dict | None) -> None:
        """Another study's record of this very run (a run folder of the shared pool that study trained,
        one it took further than this folder, or the folder gone) is copied marked shared_from, so the
        run's CPU time is counted once, where it was trained; else the run folder's state is recorded."""
        found = None if _recorded(job, res) else shared_rung(job, job.stop_at, self.shared)
        if found is not None and folder is not None and _further(folder, found[0]):
            found = None  # the run went on here since that record: this study's own record of where it is
        if found is not None:
            adopt_rung(self.study, job, *found)
            self.say(f"shared {job.tag} ({Path(job.record).name}): the run {found[1].parents[2].name}/screen/"
                     f"{found[1].parent.name}/{found[1].name} recorded at step {found[0].get('steps')} (same identity)")
        elif folder is not None and not _recorded(job, res) and ranks(job.run_dir, folder, job.stop_at, name=False):
            write_record(self.study, job, res, self.parallel, rung=job.stop_at)


def _recorded(job: Job, res: dict) -> bool:
    """The rung record already holds the run as it is (a later rung's record is not replaced by an
    earlier rung's job finding the same run)."""
    old = rung_record(job, job.stop_at)
    rung = old.get("rung") if old is not None else None
    return (old is not None and _state(old) == _state(res) and isinstance(rung, int) and not isinstance(rung, bool)
            and rung >= job.stop_at)


def _further(a: dict, b: dict) -> bool:
    """Results a are further along than b: finished where b is not, or more steps."""
    if (a.get("status") in FINISHED) != (b.get("status") in FINISHED):
        return a.get("status") in FINISHED
    steps = [r.get("steps") if isinstance(r.get("steps"), (int, float)) and not isinstance(r.get("steps"), bool)
             else 0 for r in (a, b)]
    return steps[0] > steps[1]


def _state(res: dict) -> tuple:
    return res.get("status"), res.get("steps")


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
        data = read_choice(out / "screen" / f"{arm.name}.json", list(settings)) if study.screened(arm) else None
        if data:
            found[arm.name] = setting_overrides(settings[data["chosen"]])
    return found


def check_choices(study: Study, out: Path) -> None:
    """Refuse to screen over a damaged choice file (<out>/screen/<arm>.json), or a file where the
    screen's folders should be: one line, nothing changed."""
    screened = [a for a in study.arms.values() if study.screened(a)]
    for folder in (out / "screen", *(out / "screen" / a.name for a in screened)):
        if folder.exists() and not folder.is_dir():
            raise UserError(str(folder), "a file where the screen's folder should be (move it away)")
    for arm in screened:
        path = out / "screen" / f"{arm.name}.json"
        problem = choice_problem(path)
        if problem:
            raise UserError(str(path), f"{problem}: {NOT_DECIDED.replace('treated as not decided and ', '')}")


def run_screens(study: Study, runs: Path, out: Path, parallel: int = 1, launch: list[str] = (),
                records: Path | None = None) -> int:
    """Screen every screened arm without a choice; 0 when all are decided, 128+signal when stopped.
    `records`: the folder of every study's records (experiments/), whose rung records of the same
    runs are taken (rung_index); None: this study's own only."""
    screen = study.screen
    check_choices(study, out)
    arms = [a for a in study.arms.values() if study.screened(a) and a.name not in choices(study, out)]
    if not arms:
        return 0
    cfg = compose(study.arm_overrides(arms[0], screen.seed))  # the budget's steps and validation interval
    check_rungs(screen, int(cfg.trainer.max_steps), cfg.trainer.val_check_interval)
    names = [setting_name(s) for s in screen.settings()]
    rows = {a.name: {n: {"name": n, "overrides": setting_overrides(s), "values": {}, "status": None, "dropped_at": None}
                     for n, s in zip(names, screen.settings())} for a in arms}
    alive = {a.name: list(names) for a in arms}
    shared = rung_index(records)  # once: every study's rung records, by identity hash
    for i, rung in enumerate(screen.rungs):
        jobs = {a.name: screen_jobs(study, a, runs, out, alive[a.name], rung) for a in arms}
        sweep = RungSweep(study, [j for js in jobs.values() for j in js.values()], runs, parallel, launch,
                          shared=shared)
        code = sweep.run()
        if code:
            return code
        if sweep.failed or sweep.refused:  # a crash or a damaged results.json is not a result: retried next time
            return 1
        for arm in arms:
            alive[arm.name] = _rung(screen, i, rung, jobs[arm.name], rows[arm.name], shared)
    for arm in arms:  # one left after the last rung (screen.kept), or none if every setting failed
        chosen = alive[arm.name][0] if alive[arm.name] else None
        write_choice(out / "screen" / f"{arm.name}.json", arm.name, screen, list(rows[arm.name].values()), chosen)
    return 0


def _rung(screen, i: int, rung: int, jobs: dict[str, Job], rows: dict[str, dict],
          shared: dict[str, Path] | None = None) -> list[str]:
    """Rank the settings that reached the rung; return those that go on, mark the others dropped."""
    values = {}
    for name, job in jobs.items():
        res, metrics = rung_results(job, rung, shared)  # the run folder's, else a rung record's where it is gone
        rows[name]["status"] = res.get("status")
        rows[name]["floor"] = res.get("input_independent_loss")  # L*: a value at it is a stall the guard had no time to see
        if res.get("status") == "completed" or res.get("status") == "stopped":
            values[name] = ranked_value(metrics, rung, screen.by, res.get("status"))
        else:  # diverged or stalled before the rung: out
            values[name] = None
        rows[name]["values"][str(rung)] = values[name]
    kept = survivors(screen, i, values)
    for name in jobs:
        if name not in kept:
            rows[name]["dropped_at"] = rung
    return kept
