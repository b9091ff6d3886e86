"""What a study has done and what is left, read from its records and run folders without running,
copying or writing anything: `normlab-study NAME --status`.

    deep_recent (full): 28 runs planned: 4 recorded, 1 training now, 1 stopped part-way, 22 not started
      b2t seed 1          training now: step 800 of 2000, training ends in about 0:14:10 (its step-600 checkpoint kept if stopped)
      mix seed 1          stopped part-way: its step-1200 checkpoint of 2000; the study continues it
      ...
    left: about 4.40 machine-hours (the mean of its 2 completed runs, 0.19 h a run, for each run not done, ...)

A run's state: recorded in the study's folder (done); recorded by another study (the same run, by
its identity: copied in when the study next runs); finished in its run folder but not yet recorded
(the study records, or prunes and records, it when it next runs); failed (the study runs it again);
training now (another process holds its folder: run_folder.held_elsewhere); stopped part-way (its
last full checkpoint is where it continues); damaged (its record or run folder holds a results.json
that cannot be read, named in a warning: study/damaged.py; the study leaves the file and does not run
the job while it is there); or not started. Machine-hours as the README's Cost line counts them
(readme.machine_share), the mean over the study's completed runs: a stalled or diverged run stops
early and would make the estimate short.
"""
from __future__ import annotations

import re
from pathlib import Path

from normlab.outcome import FINISHED
from normlab.run_folder import full_checkpoints
from normlab.study.plan import Job
from normlab.study.runner import damaged_job, prune_command, record_done, run_results, run_summary, shared_index, shared_source
from normlab.study.spec import Study

_STEP = re.compile(r"step (\d+)/(\d+)(?:.*?\| eta (\d+:\d\d:\d\d))?")


def log_progress(run_dir: Path) -> tuple[int, int | None, int | None, str]:
    """(the step of its last full checkpoint, the step its log last reached, the steps planned, the
    training time left its log last estimated)."""
    ckpts = [step for step, _ in full_checkpoints(run_dir / "checkpoints")]
    last = planned = None
    eta = ""
    try:
        with open(run_dir / "train.log", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            found = _STEP.findall(f.read().decode(errors="replace"))
        if found:
            last, planned, eta = int(found[-1][0]), int(found[-1][1]), found[-1][2]
    except OSError:
        pass
    return max(ckpts, default=0), last, planned, eta


def job_state(job: Job, shared: dict[str, Path]) -> tuple[str, str, float]:
    """(state, text, the fraction of the run done) of one planned run."""
    from normlab.run_folder import held_elsewhere

    where = damaged_job(job)  # named in a warning (study/damaged.py); the study leaves it and does not run it
    if where:
        return "damaged", f"{where}'s results.json is damaged (see its warning): not run while it is there", 0.0
    res = record_done(job)
    if res is not None:
        origin = (res.get("shared_from") or {}).get("study")
        return "recorded", f"recorded{f' (shared from {origin})' if origin else ''}: {run_summary(res)}", 1.0
    src = shared_source(job, shared)
    if src is not None:
        return "recorded", f"recorded by {src.parents[1].name} (the same run): copied in when the study runs", 1.0
    if not job.run_dir.is_dir():
        return "not started", "not started", 0.0
    res = run_results(job) or {}
    if res.get("status") in FINISHED:
        todo = "pruned and recorded" if res.get("status") == "completed" and prune_command(job) else "recorded"
        return "finished", f"finished ({run_summary(res)}); {todo} when the study next runs", 1.0
    ckpt, last, planned, eta = log_progress(job.run_dir)
    of = f" of {planned}" if planned else ""
    # a run stopped in its final scoring has a checkpoint at its last step and its scoring still to do
    done = min(ckpt / planned, 0.9) if planned else 0.0
    if held_elsewhere(job.run_dir):
        since = f" (its step-{ckpt} checkpoint kept if stopped)" if ckpt else ""
        left = f", training ends in about {eta}" if eta else ""
        now = f"step {last}{of}{left}" if last is not None else "starting"
        return "training now", f"training now: {now}{since}", done
    if res.get("status") == "failed":
        error = str(res.get("error") or "no error recorded").strip().splitlines()[-1][:160]
        return "failed", f"failed ({error}); the study runs it again", done
    if ckpt:
        return "stopped part-way", f"stopped part-way: its step-{ckpt} checkpoint{of}; the study continues it", done
    return "not started", "started, no checkpoint yet: starts over", 0.0


def status_lines(study: Study, jobs: list[Job], records: Path | None) -> list[str]:
    """The study's planned runs, their states and the machine-hours left (an estimate)."""
    from normlab.study.readme import machine_share

    shared = shared_index(records) if records is not None else {}
    rows = [(job, *job_state(job, shared)) for job in jobs]
    order = ("recorded", "finished", "training now", "stopped part-way", "failed", "damaged", "not started")
    counts = {s: sum(1 for r in rows if r[1] == s) for s in order}
    head = f"{study.name} ({study.budget}): {len(jobs)} runs planned: " + ", ".join(
        f"{n} {s}" for s, n in counts.items() if n or s in ("recorded", "not started"))
    width = max((len(j.tag) for j in jobs), default=0) + 2
    lines = [head, *(f"  {job.tag:<{width}}{text}" for job, _, text, _ in rows)]
    recs = [r for r in (record_done(job) for job, state, _, _ in rows if state == "recorded") if r and r.get("wall_s")]
    done = [r for r in recs if r.get("status") == "completed"] or recs  # stalled and diverged runs stop early
    hours = [float(r["wall_s"]) * machine_share(r) / 3600 for r in done]
    left = sum(1.0 - frac for _, _, _, frac in rows)
    if not left:
        lines.append("left: nothing: every planned run is recorded or finished")
    elif hours:
        mean = sum(hours) / len(hours)
        which = "completed" if all(r.get("status") == "completed" for r in done) else "recorded"
        lines.append(f"left: about {left * mean:.2f} machine-hours (the mean of its {len(hours)} {which} runs, "
                     f"{mean:.2f} h a run, for each run not done, less what its checkpoint holds; arms that have "
                     "not run may cost more or less)")
    else:
        lines.append(f"left: {left:.1f} runs' worth; no estimate of their time (no run of this study recorded yet)")
    return lines
