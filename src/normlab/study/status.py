"""What a study has done and what is left, read from its records and run folders without running,
copying or writing anything: `normlab-study NAME --status`.

    deep_recent (full): 28 runs planned: 4 recorded, 1 training now, 1 stopped part-way, 22 not started
      b2t seed 1          training now: step 800 of 2000 (continues from its step-600 checkpoint if stopped)
      mix seed 1          stopped part-way: its step-1200 checkpoint of 2000; the study continues it
      ...
    left: about 4.40 machine-hours (the mean of its 4 recorded runs, 0.19 h a run, for each run not recorded ...)

A run's state: recorded in the study's folder (done); recorded by another study (the same run, by
its identity: copied in when the study next runs); finished in its run folder but not yet recorded
(the study records or prunes it when it next runs); training now (another process holds its folder:
run_folder.held_elsewhere); stopped part-way (its last full checkpoint is where it continues); or
not started. Machine-hours as the README's Cost line counts them (readme.machine_share).
"""
from __future__ import annotations

import re
from pathlib import Path

from normlab.outcome import FINISHED
from normlab.study.runner import Job, _pruned_as, record_done, run_results, run_summary, shared_index
from normlab.study.spec import Study

_STEP = re.compile(r"step (\d+)/(\d+)(?:.*?\| eta (\d+:\d\d:\d\d))?")


def _progress(run_dir: Path) -> tuple[int, int | None, int | None, str]:
    """(the step of its last full checkpoint, the step its log last reached, the steps planned, the
    training time left its log last estimated)."""
    ckpts = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("full-step*.ckpt")
             if (m := re.fullmatch(r"full-step(\d+)\.ckpt", p.name))]
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

    res = record_done(job)
    if res is not None:
        origin = (res.get("shared_from") or {}).get("study")
        return "recorded", f"recorded{f' (shared from {origin})' if origin else ''}: {run_summary(res)}", 1.0
    src = shared.get(job.identity_hash)
    if src is not None and src != job.record and (not job.arm.prune or _pruned_as(src, job.arm.prune)):
        return "recorded", f"recorded by {src.parents[1].name} (the same run): copied in when the study runs", 1.0
    if not job.run_dir.is_dir():
        return "not started", "not started", 0.0
    res = run_results(job) or {}
    ckpt, last, planned, eta = _progress(job.run_dir)
    if res.get("status") in FINISHED:
        return "finished", f"finished ({run_summary(res)}); recorded when the study next runs", 1.0
    of = f" of {planned}" if planned else ""
    done = ckpt / planned if planned else 0.0
    if held_elsewhere(job.run_dir):
        since = f" (its step-{ckpt} checkpoint kept if stopped)" if ckpt else ""
        left = f", training ends in about {eta}" if eta else ""
        return "training now", f"training now: step {last or 0}{of}{left}{since}", done
    if ckpt:
        return "stopped part-way", f"stopped part-way: its step-{ckpt} checkpoint{of}; the study continues it", done
    return "not started", "started, no checkpoint yet: starts over", 0.0


def status_lines(study: Study, jobs: list[Job], records: Path | None) -> list[str]:
    """The study's planned runs, their states and the machine-hours left (an estimate)."""
    from normlab.study.readme import machine_share

    shared = shared_index(records) if records is not None else {}
    rows = [(job, *job_state(job, shared)) for job in jobs]
    order = ("recorded", "finished", "training now", "stopped part-way", "not started")
    counts = {s: sum(1 for r in rows if r[1] == s) for s in order}
    head = f"{study.name} ({study.budget}): {len(jobs)} runs planned: " + ", ".join(
        f"{n} {s}" for s, n in counts.items() if n or s in ("recorded", "not started"))
    width = max((len(j.tag) for j in jobs), default=0) + 2
    lines = [head, *(f"  {job.tag:<{width}}{text}" for job, _, text, _ in rows)]
    hours = [float(r.get("wall_s") or 0) * machine_share(r) / 3600
             for r in (record_done(job) for job, state, _, _ in rows if state == "recorded") if r and r.get("wall_s")]
    left = sum(1.0 - frac for _, _, _, frac in rows)
    if not left:
        lines.append("left: nothing: every planned run is recorded or finished")
    elif hours:
        mean = sum(hours) / len(hours)
        lines.append(f"left: about {left * mean:.2f} machine-hours (the mean of its {len(hours)} recorded runs, "
                     f"{mean:.2f} h a run, for each run not done, less what its checkpoint holds; arms that have "
                     "not run may cost more or less)")
    else:
        lines.append(f"left: {left:.1f} runs' worth; no estimate of their time (no run of this study recorded yet)")
    return lines
