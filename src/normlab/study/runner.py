"""Run a study's sweep (planned by plan.py): every (arm, seed) as one `normlab-train` process, then its post-steps (the
prune command), then a compact record of the run in the study's folder.

Where things go (the study command sets them):
- run folders: <runs>/<run name> (checkpoints, logs; not in the repository). A run's name is its
  identity (identity.run_name), so rerunning the study finds an unfinished run and continues it
  exactly (train.py's continuation), and a finished one is not trained again.
- records: <out>/runs/<arm>-s<seed>/ (results.json, test.hyp.gz, metrics.csv, prune.json): what the
  report and the claims read, small enough to commit. A record whose identity hash matches the
  run the study would launch counts as done, so a study continues across machines from its
  committed records.
- a screen's rung records: <out>/screen/<arm>/<setting>/ (results.json with the rung, metrics.csv;
  screen_run.py), written as each setting's run reaches its rung, so a screen continues across
  machines too: a setting whose record reached the rung is ranked from it and trains nothing; one
  that goes on trains again from step 0 where its run folder is gone (its checkpoint is not
  committed); another study's rung record of the same run (the same identity hash) is taken as
  its own and copied, marked `shared_from`, as a seed's record is (adopt_shared). The choice:
  <out>/screen/<arm>.json.
SIGTERM / SIGINT: every running job gets SIGTERM (each writes a full checkpoint and stops,
`status: preempted`); the study exits 143 / 130 and the same command continues it.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from normlab.outcome import FINISHED
from normlab.study.cpu_ledger import with_ledger
from normlab.study.damaged import is_damaged, json_object, read_results
from normlab.study.plan import Job
from normlab.study.record_swap import write_record_folder
from normlab.study.spec import Study, own_groups



def record_done(job: Job) -> dict | None:
    res = read_results(job.record / "results.json", record=True)  # None: none, or damaged (named)
    if res is None:
        return None
    if res.get("identity_hash") != job.identity_hash or res.get("status") not in FINISHED:
        return None
    if (job.arm.prune and res.get("status") == "completed" and not list(job.record.glob("prune.*.test.hyp.gz"))
            and (job.run_dir / "results.json").is_file()):
        return None  # pruned before pruning kept its translations: prune again (the run folder is here)
    return res


def damaged_job(job: Job) -> str | None:
    """Where the job holds a damaged results.json ("its record", "its run folder"; named once,
    study/damaged.py), else None: the study does not run it, which would replace the file, until a
    person moves the file away."""
    if is_damaged(job.record / "results.json", record=True):
        return "its record"
    return "its run folder" if is_damaged(job.run_dir / "results.json", record=False) else None


def adopt_shared(jobs: list[Job], records: Path, say=print) -> list[Job]:
    """Jobs whose run another study has recorded (the same identity hash, finished, under
    <records>/<study>/runs/): its record is copied into this study's, marked `shared_from`, so a run
    two studies share is trained once on any machine, not only where its run folder still is. A
    pruned arm adopts only a record with the prune's translations. Returns the jobs adopted."""
    index = shared_index(records)
    adopted = []
    for job in jobs:
        src = shared_source(job, index)
        if src is None or damaged_job(job) or (record_done(job) is not None and not _stale_copy(job.record, src)):
            continue
        res = read_results(src / "results.json", record=True, seed=False)
        if res is None:  # damaged since shared_index read it
            continue
        origin = res.get("study") or {}
        # the folders name the studies (a record keeps the name its study had when it ran)
        res.update(study={**origin, "name": job.record.parents[1].name, "arm": job.arm.name, "seed": job.seed,
                          "overrides": job.overrides},
                   shared_from={"study": src.parents[1].name, "record": src.name})
        write_record_folder(job.record, lambda tmp: copy_record(src, tmp, res))
        say(f"shared {job.tag}: the run {src.parents[1].name}/{src.name} recorded (same identity)")
        adopted.append(job)
    return adopted


def shared_index(records: Path) -> dict[str, Path]:
    """{identity hash: the record of that run} over <records>/<study>/runs/: finished runs a study
    trained (the study that trained a run wins over one that adopted it). Trained there: the record's
    W&B group is the folder's study's, under its name or one it had before a rename (spec.own_groups:
    twt_lowres_2k's records are in study-twt_lowres); `shared_from` alone does not say so, a record
    written from a run folder another study trained has none."""
    index: dict[str, Path] = {}
    groups: dict[str, set[str]] = {}
    for res_path in sorted(records.glob("*/runs/*/results.json")) if records.is_dir() else []:
        if res_path.parent.name.startswith("."):  # a record being written, or replaced (record_swap: not read here)
            continue
        res = read_results(res_path, record=True, seed=False)  # looked up by identity, not by seed
        if res is None:
            continue
        if res.get("status") in FINISHED and not res.get("shared_from") and res.get("identity_hash"):
            study = res_path.parents[2].name
            if study not in groups:  # each study's file read once (setdefault would read it for every record)
                groups[study] = own_groups(study)
            trained_here = res.get("group") in groups[study]  # the study that trained it
            if trained_here or res["identity_hash"] not in index:
                index[res["identity_hash"]] = res_path.parent
    return index


def shared_source(job: Job, index: dict[str, Path]) -> Path | None:
    """Another study's record of the job's run (shared_index), if it holds what the arm needs: a
    pruned arm takes only a record pruned as it prunes."""
    src = index.get(job.identity_hash)
    if src is None or src == job.record or (job.arm.prune and not _pruned_as(src, job.arm.prune)):
        return None
    return src


def _stale_copy(record: Path, src: Path) -> bool:
    """A record adopted from src that src no longer matches (its study rescored or pruned it again
    since): copied again, so the two studies judge the same run by the same numbers."""
    mine, theirs = read_results(record / "results.json", True), read_results(src / "results.json", True, seed=False)
    if mine is None or theirs is None:
        return False
    if (mine.get("shared_from") or {}) != {"study": src.parents[1].name, "record": src.name}:
        return False  # trained here, or adopted from another study's record: left as it is
    strip = lambda r: {k: v for k, v in r.items() if k not in ("study", "shared_from")}  # noqa: E731
    files = lambda d: {p.name: p.stat().st_size for p in d.iterdir() if p.name != "results.json"}  # noqa: E731
    return strip(mine) != strip(theirs) or files(record) != files(src)


def _pruned_as(record: Path, prune: dict) -> bool:
    """Whether a record holds the pruned models (every strategy x depth, with translations) an arm's
    prune settings ask for: another study may have pruned the same run otherwise."""
    data, _ = json_object(record / "prune.json")
    rows = (data or {}).get("rows") or []
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return False
    have = {(r.get("strategy"), r.get("kept")) for r in rows}
    want = {(st, d) for st in prune.get("strategies") or [] for d in prune.get("depths") or []}
    return want <= have and all((record / f"prune.{st}.r{d}.test.hyp.gz").is_file() for st, d in want)


def run_results(job: Job) -> dict | None:
    """The run folder's results.json; None when there is none or it is damaged (named once)."""
    return read_results(job.run_dir / "results.json", record=False)


def copy_record(src: Path, tmp: Path, res: dict) -> None:
    """Another study's record `src` copied into the temp folder, its results.json replaced by `res`."""
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    (tmp / "results.json").write_text(json.dumps(res, indent=2, default=str) + "\n")


def write_record(study: Study, job: Job, res: dict, jobs: int = 1, rung: int | None = None) -> None:
    """Copy what the report needs from the run folder into the record (whole: record_swap). `jobs`:
    the runs that shared the machine with it (its wall time counts 1/jobs of the machine's). `rung`: a
    screen's run paused at (or ended before) that rung (screen_run.RungSweep): its results, named by the
    run's identity hash and the rung, with the CPU time spent on the setting so far (cpu_ledger: the
    record it replaces may hold work this run does not), and its metrics.csv only (no checkpoint, no
    translations), what the screen ranks by."""
    res = dict(res, study={"name": study.name, "arm": job.arm.name, "seed": job.seed, "budget": study.budget,
                           "overrides": job.overrides, "run_dir": str(job.run_dir), "jobs": jobs})
    if rung is not None:  # the run folder names its identity; the job's is the same (the folder is named by it)
        res.update(identity_hash=res.get("identity_hash") or job.identity_hash, rung=rung)
        res = with_ledger(res, read_results(job.record / "results.json", record=True), study.name)
    write_record_folder(job.record, lambda tmp: _fill_record(job, res, tmp, rung is None))


def _fill_record(job: Job, res: dict, tmp: Path, whole: bool) -> None:
    """The record's files from the run folder; `whole`: with its translations and prune (a seed's)."""
    (tmp / "results.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    hyp = job.run_dir / "test.hyp"
    if hyp.is_file() and whole:
        with open(hyp, "rb") as src, gzip.GzipFile(tmp / "test.hyp.gz", "wb", mtime=0) as dst:
            shutil.copyfileobj(src, dst)
    if (job.run_dir / "csv" / "metrics.csv").is_file():
        shutil.copy(job.run_dir / "csv" / "metrics.csv", tmp / "metrics.csv")
    if (job.run_dir / "prune" / "prune.json").is_file() and whole:
        shutil.copy(job.run_dir / "prune" / "prune.json", tmp / "prune.json")
        for hyp in sorted((job.run_dir / "prune" / "hyps").glob("*-r*.test.hyp")):  # every_other-r3.test.hyp
            strategy, kept = hyp.name[:-len(".test.hyp")].rsplit("-r", 1)
            with open(hyp, "rb") as src, gzip.GzipFile(tmp / f"prune.{strategy}.r{kept}.test.hyp.gz", "wb",
                                                       mtime=0) as dst:
                shutil.copyfileobj(src, dst)


def prune_command(job: Job, extra: dict | None = None) -> list[str] | None:
    """The prune command for the arm's settings (depths, strategies, decoder), the budget's on top."""
    out = job.run_dir / "prune"
    # done when its table and its models' translations are there (a prune from before the
    # translations were kept runs again, for the bootstrap over sentences)
    if not job.arm.prune or ((out / "prune.json").is_file() and any((out / "hyps").glob("*.test.hyp"))):
        return None
    p = {**job.arm.prune, **(extra or {})}
    cmd = [sys.executable, "-m", "normlab.commands.prune", str(job.run_dir), "--out", str(out), "--force"]
    if p.get("strategies"):
        cmd += ["--strategies", ",".join(map(str, p["strategies"]))]
    if p.get("depths"):
        cmd += ["--depths", ",".join(map(str, p["depths"]))]
    for flag in ("beam", "max_sentences", "max_len_a", "max_len_b"):
        if p.get(flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(p[flag])]
    return cmd


class Sweep:
    """Runs the jobs, `jobs` at a time (threads split between them), logging to <runs>/study.log."""

    def __init__(self, study: Study, jobs: list[Job], runs: Path, parallel: int = 1, launch: list[str] = ()):
        self.study, self.todo, self.runs, self.parallel = study, jobs, runs, max(1, parallel)
        self.launch = list(launch)
        self.running: dict[subprocess.Popen, tuple[Job, str, float]] = {}
        self.stopping = 0
        self.failed: list[str] = []
        self.refused: list[str] = []  # jobs left out: a damaged results.json in their record or run folder
        self.total, self.recorded = len(jobs), 0  # run() counts them
        self.trained: list[tuple[float, bool]] = []  # (wall s, completed) of each run whose training it finished
        runs.mkdir(parents=True, exist_ok=True)
        (runs / "logs").mkdir(exist_ok=True)
        self.log_file = open(runs / "study.log", "a", encoding="utf-8")

    def say(self, text: str) -> None:
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {text}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def _env(self) -> dict:
        env = dict(os.environ)
        if self.parallel > 1:  # split the cores: each job's torch uses its share
            threads = str(max(1, (os.cpu_count() or 1) // self.parallel))
            env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        return env

    def _start(self, job: Job, stage: str, cmd: list[str]) -> None:
        log = open(self.runs / "logs" / f"{job.arm.name}-s{job.seed}.{stage}.log", "a", encoding="utf-8")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env())
        log.close()
        self.running[proc] = (job, stage, time.time())

    def _train_command(self, job: Job) -> list[str]:
        pause = [f"callbacks.preemption.stop_at_step={job.stop_at}"] if job.stop_at else []  # not identity
        # the W&B group follows from the labels: study-<name>, study-<name>-smoke (run_identity)
        return [sys.executable, "-m", "normlab.commands.train", *job.overrides, *job.labels, *pause, *self.launch,
                f"hydra.run.dir={job.run_dir}"]

    def _trained(self, job: Job, res: dict) -> bool:
        """The job's training is over (a finished run; a screen's rung job: also a run paused there)."""
        return res.get("status") in FINISHED

    def _next(self, job: Job) -> None:
        """Start the job's next stage, or write its record when it has none left."""
        res = run_results(job)
        if res is None or res.get("status") not in FINISHED:
            self._start(job, "train", self._train_command(job))
            self.say(f"start {job.tag}: {job.run_dir}")
            return
        cmd = prune_command(job, self.study.prune_overrides) if res.get("status") == "completed" else None
        if cmd:
            self._start(job, "prune", cmd)
            self.say(f"prune {job.tag}")
            return
        write_record(self.study, job, res, self.parallel)
        self.recorded += 1
        self.say(f"done  {job.tag}: {run_summary(res)} ({self._progress()})")

    def _progress(self) -> str:
        """'k of N recorded' and, once this sweep has trained a run, the time left at its pace: the
        mean wall time of the completed runs whose training it finished (each over all its legs,
        so a run it only continued counts whole; stalled ones only while none completed), over the
        jobs at a time. Runs found finished (recorded at once) and runs it only pruned are not a
        pace; failed runs are not left (the next sweep retries them)."""
        text = f"{self.recorded} of {self.total} recorded"
        left = self.total - self.recorded - len(self.failed) - len(self.refused)  # failed ones wait for the next
        pace = [t for t, done in self.trained if done] or [t for t, _ in self.trained]  # stalls stop early
        if left > 0 and pace:
            secs = int(sum(pace) / len(pace) * left / min(self.parallel, left))
            text += f"; about {secs // 3600}:{secs // 60 % 60:02d} left at this sweep's pace"
        return text

    def _signal(self, signum, frame) -> None:
        self.stopping = signum
        for proc in self.running:
            proc.send_signal(signal.SIGTERM)  # each job checkpoints at the end of its step and exits

    def run(self) -> int:
        """0 when every job finished; 128+signal when stopped by one."""
        old = {s: signal.signal(s, self._signal) for s in (signal.SIGTERM, signal.SIGINT)}
        total = self.total = len(self.todo)
        done = [j for j in self.todo if record_done(j)]
        refused = [j for j in self.todo if j not in done and damaged_job(j)]  # named once, left as they are
        self.recorded, self.refused = len(done), [j.tag for j in refused]
        self.todo = [j for j in self.todo if j not in done and j not in refused]
        self.say(f"study {self.study.name} ({self.study.budget}): {total} runs, {len(done)} already recorded, "
                 f"{len(self.todo)} to run, {self.parallel} at a time"
                 + (f"; {len(refused)} left out ({', '.join(self.refused)}: a damaged results.json, named above)"
                    if refused else ""))
        try:
            while (self.todo or self.running) and not self.stopping:
                while self.todo and len(self.running) < self.parallel and not self.stopping:
                    self._next(self.todo.pop(0))
                self._reap()
            while self.running:  # stopping: wait for the jobs to checkpoint
                self._reap()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.log_file.close() if self.stopping else None
        if self.stopping:
            print(f"stopped by signal {self.stopping}: rerun the same command to continue", flush=True)
            return 128 + int(self.stopping)
        return 0

    def _reap(self) -> None:
        time.sleep(0.2)
        for proc in [p for p in self.running if p.poll() is not None]:
            job, stage, t0 = self.running.pop(proc)
            if self.stopping:
                self.say(f"stopped {job.tag} ({stage}, exit {proc.returncode}): continues on the next run")
                continue
            res = run_results(job) or {}
            if stage == "train" and not self._trained(job, res):
                msg = res.get("error") or f"exit status {proc.returncode}"
                self.failed.append(job.tag)
                self.say(f"FAILED {job.tag}: status {res.get('status', 'none')}: {str(msg).splitlines()[-1][:200]} "
                         f"(log: {self.runs / 'logs'}/{job.arm.name}-s{job.seed}.train.log)")
                continue
            if stage == "train":  # the run's wall time over all its legs: a continued run is a whole run
                self.trained.append((float(res.get("wall_s") or time.time() - t0), res.get("status") == "completed"))
            if stage == "prune" and proc.returncode != 0:
                self.failed.append(job.tag)
                self.say(f"FAILED {job.tag}: prune exit status {proc.returncode}")
                continue
            self._next(job)


def run_summary(res: dict) -> str:
    parts = [f"status {res.get('status')}"]
    for key, label in (("test_bleu", "test BLEU"), ("valid_bleu", "valid BLEU"), ("steps", "steps"),
                       ("wall_s", "wall s")):
        if res.get(key) is not None:
            parts.append(f"{label} {res[key]}")
    return ", ".join(parts)
