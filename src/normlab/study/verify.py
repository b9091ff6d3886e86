"""Check a record by rerunning it: `normlab-study NAME --verify RUN [--steps N]` trains the first N
optimizer steps of the record's run again, at its recorded settings (results.json `study.overrides`),
thread count (`device`) and kernel path where this CPU has it (`cpu`), into a temporary folder (never
the study's run folders), and compares every training loss the record logged in those steps
(metrics.csv train/loss and train/nll, every trainer.log_every_n_steps) with the rerun's, to the bit.

The rerun is the run itself, paused: `callbacks.preemption.stop_at_step=N` is not part of the
identity and changes nothing before step N (trainer.max_steps=N would move every schedule read from
it). fp32 training is the same to the bit only for the same code, seed, thread count and CPU kernel
path (hardware.py), so a difference comes with what this rerun had that the record did not: another
commit (and whether src/ and conf/ differ from it), another kernel path or CPU, a record that names
neither (trained before they were recorded), another torch.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from normlab.errors import UserError

LOSSES = ("train/loss", "train/nll")  # what training logs (lit_module.training_step), compared as written
# torch's ATen kernel families on x86, lowest first: a lower one than the CPU's can be asked for
# (ATEN_CPU_CAPABILITY), a higher one cannot
ATEN_ORDER = ("DEFAULT", "AVX2", "AVX512")


@dataclass
class Verdict:
    equal: bool
    lines: list[str] = field(default_factory=list)  # what to print: the result, then why it may differ


def find_record(out: Path, run: str) -> Path:
    """A record by name (pre_ln-s1, under <out>/runs/) or by path (a folder holding results.json)."""
    path = Path(run)
    if (path / "results.json").is_file():
        return path
    if (out / "runs" / run / "results.json").is_file():
        return out / "runs" / run
    names = sorted(p.parent.name for p in (out / "runs").glob("*/results.json") if not p.parent.name.startswith("."))
    raise UserError("--verify", f"{run!r} is not a record of {out}/runs nor a folder with a results.json",
                    names or "none recorded yet")


def logged_losses(metrics: Path) -> dict[int, dict[str, str]]:
    """{step: {"train/loss": "8.3657...", ...}} as the CSV logger wrote them (step: metrics.csv's, the
    optimizer steps done before it). Strings: a float32 written by the same logger is the same text
    exactly when it is the same number."""
    out: dict[int, dict[str, str]] = {}
    with open(metrics, newline="") as f:
        for row in csv.DictReader(f):
            vals = {k: row[k] for k in LOSSES if row.get(k) not in (None, "")}
            if vals and str(row.get("step", "")).isdigit():
                out[int(row["step"])] = vals
    return out


def recorded_threads(res: dict) -> int | None:
    m = re.search(r", (\d+) threads?$", str(res.get("device") or ""))
    return int(m.group(1)) if m else None


def rerun_env(res: dict, here: dict, env: dict | None = None) -> tuple[dict, list[str]]:
    """The environment of the rerun and what it sets: the record's thread count (as the study's Sweep
    sets it: OMP_NUM_THREADS and MKL_NUM_THREADS, which torch's intra-op pool follows), the kernel
    overrides the record names (MKL_CBWR=..., hardware.OVERRIDES), and the record's ATen kernels
    where they are below this CPU's (never over an ATEN_CPU_CAPABILITY set by the user)."""
    env = dict(os.environ if env is None else env)
    notes = []
    threads = recorded_threads(res)
    if threads is None:  # the Sweep's split of this machine for the record's jobs
        jobs = int((res.get("study") or {}).get("jobs") or 1)
        threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None
        notes.append("the record names no thread count: rerun with "
                     + (f"{threads} (this machine's cores over its {jobs} jobs)" if threads else "torch's default"))
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cpu = res.get("cpu") if isinstance(res.get("cpu"), dict) else {}
    for lib in ("mkl", "onednn"):  # "2024.2, MKL_CBWR=AVX2": the override the record ran under
        for item in str(cpu.get(lib) or "").partition(", ")[2].split(", "):
            name, sep, value = item.partition("=")
            if sep:
                env[name] = value
    theirs, ours = str(cpu.get("capability") or "").upper(), str(here.get("capability") or "").upper()
    if (theirs in ATEN_ORDER and ours in ATEN_ORDER and ATEN_ORDER.index(theirs) < ATEN_ORDER.index(ours)
            and not env.get("ATEN_CPU_CAPABILITY")):
        env["ATEN_CPU_CAPABILITY"] = theirs.lower()
        notes.append(f"ATen kernels {theirs} as the record's (ATEN_CPU_CAPABILITY={theirs.lower()}; this CPU's: {ours})")
    return env, notes


def train_command(res: dict, steps: int, run_dir: Path, launch: list[str] = ()) -> list[str]:
    """The record's run (its overrides), paused after `steps` (not identity), logged to CSV only."""
    overrides = list((res.get("study") or {}).get("overrides") or [])
    return [sys.executable, "-m", "normlab.commands.train", *overrides, *launch,
            f"callbacks.preemption.stop_at_step={steps}", "logger=csv", f"hydra.run.dir={run_dir}"]


def compare(theirs: dict[int, dict[str, str]], ours: dict[int, dict[str, str]], steps: int) -> Verdict:
    """Every loss the record logged in the first `steps` optimizer steps against the rerun's."""
    due = sorted(s for s in theirs if s < steps)
    same = 0
    for step in due:
        for key, want in theirs[step].items():
            got = ours.get(step, {}).get(key)
            if got != want:
                rel = (f", relative difference {abs(float(got) - float(want)) / max(abs(float(want)), 1e-30):.1e}"
                       if got is not None else "")
                return Verdict(False, [f"differs: step {step} (metrics.csv) {key}: record {want}, rerun {got}{rel}; "
                                       f"{same} of {len(due)} logged steps before it equal"])
        same += 1
    return Verdict(True, [f"verified: {same} of {len(due)} logged losses equal to the bit ({', '.join(LOSSES)} at "
                          f"metrics.csv steps {due[0]}..{due[-1]})"])


def verify(record: Path, steps: int, launch: list[str] = (), say=print) -> int:
    """0: every logged loss equal; 1: one differs (or the rerun logged none); raises UserError for a
    record that cannot be checked."""
    from normlab.hardware import cpu_info

    res = json.loads((record / "results.json").read_text())
    if not (record / "metrics.csv").is_file() or not (res.get("study") or {}).get("overrides"):
        raise UserError(f"{record}", "a record without metrics.csv or study.overrides cannot be rerun")
    theirs = logged_losses(record / "metrics.csv")
    if not theirs:
        raise UserError(f"{record}/metrics.csv", "no training loss logged")
    if min(theirs) >= steps:  # metrics.csv's step k is the loss of optimizer step k + 1
        first = min(theirs) + 1
        raise UserError("--steps", f"{steps}: {record.name} logged its first loss at step {first} (metrics.csv step "
                                   f"{first - 1}): nothing to compare before it", f"{first} or more")
    env, notes = rerun_env(res, cpu_info())
    run_dir = Path(tempfile.mkdtemp(prefix=f"normlab-verify-{record.name}-"))
    cmd = train_command(res, steps, run_dir / "run", launch)
    say(f"rerunning the first {steps} steps of {record} in {run_dir} "
        f"({env.get('OMP_NUM_THREADS', 'default')} thread(s)){''.join(f'; {n}' for n in notes)}")
    with open(run_dir / "train.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    mine = _read_json(run_dir / "run" / "results.json")
    if proc.returncode != 0 or mine.get("status") in (None, "failed", "interrupted"):
        tail = (run_dir / "train.log").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise UserError("--verify", f"the rerun failed (exit {proc.returncode}): {tail[0][:200]} "
                                    f"(log: {run_dir / 'train.log'})")
    metrics = run_dir / "run" / "csv" / "metrics.csv"
    verdict = compare(theirs, logged_losses(metrics) if metrics.is_file() else {}, steps)
    if verdict.equal:
        shutil.rmtree(run_dir, ignore_errors=True)
        say(verdict.lines[0])
        return 0
    for line in verdict.lines + [f"kept: {run_dir}", "why it may differ:"]:
        say(line)
    for reason in reasons(res, mine, steps, record):
        say(f"  - {reason}")
    return 1


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def reasons(res: dict, mine: dict, steps: int, record: Path | None = None) -> list[str]:
    """What the record's first `steps` steps ran with that this rerun (`mine`: its results.json) did
    not, or does not know: the causes a difference can have, each a line (`record`: its folder)."""
    from normlab.hardware import cpu_text

    out = []
    if res.get("identity_hash") and mine.get("identity_hash") and res["identity_hash"] != mine["identity_hash"]:
        out.append(f"settings: the record's overrides compose to another run here (identity {mine['identity_hash']}, "
                   f"recorded {res['identity_hash']}): conf/ or a default changed since")
    out += _code_reasons(res, mine.get("code") or {}, steps, record)
    theirs_cpu, ours_cpu = res.get("cpu"), mine.get("cpu") or {}
    if not isinstance(theirs_cpu, dict):
        out.append(f"kernel path: the record names none (trained before results.json had `cpu`; its device: "
                   f"{res.get('device') or 'not recorded'}); this rerun's: {cpu_text(ours_cpu)}. On another CPU "
                   "or kernel path fp32 sums round otherwise")
    elif any(theirs_cpu.get(k) != ours_cpu.get(k) for k in ("model", "isa", "capability", "mkl", "onednn")):
        out.append(f"kernel path: the record's {cpu_text(theirs_cpu)} ({theirs_cpu.get('isa')}; MKL "
                   f"{theirs_cpu.get('mkl')}; oneDNN {theirs_cpu.get('onednn')}), this rerun's {cpu_text(ours_cpu)} "
                   f"({ours_cpu.get('isa')}; MKL {ours_cpu.get('mkl')}; oneDNN {ours_cpu.get('onednn')})")
    else:
        out.append(f"kernel path: the record's ({cpu_text(ours_cpu)}): not a cause")
    theirs_t, ours_t = recorded_threads(res), recorded_threads(mine)
    if theirs_t is None:
        out.append(f"threads: the record names none (its device: {res.get('device') or 'not recorded'}); "
                   f"this rerun: {ours_t}")
    elif theirs_t != ours_t:
        out.append(f"threads: record {theirs_t}, rerun {ours_t}")
    kind = lambda r: str(r.get("device") or "").partition(":")[0]  # noqa: E731
    if kind(res) and kind(mine) and kind(res) != kind(mine):
        out.append(f"device: the record trained on {kind(res)} ({res.get('device')}), the rerun on {kind(mine)}")
    return out


def _code_reasons(res: dict, here: dict, steps: int, record: Path | None) -> list[str]:
    """The record's code for its first `steps` steps (every leg that trained some of them) against
    the rerun's: the commit, whether src/ and conf/ differ from it, uncommitted changes, torch."""
    from normlab.provenance import changed_since, first_committed

    legs = res.get("code_legs") if isinstance(res.get("code_legs"), list) else None
    if not legs:  # a record from before code_legs: its (last) leg's code, if any
        legs = [{"from_step": 0, **(res.get("code") or {"commit": None})}]
    out = []
    for leg in [g for g in legs if int(g.get("from_step") or 0) < steps]:
        commit, since = leg.get("commit"), f" (steps from {leg.get('from_step')})" if len(legs) > 1 else ""
        if not commit:
            added = first_committed(record / "results.json") if record is not None else None
            out.append(f"code: the record names none{since}: trained before its code was recorded, so there is "
                       "no commit to rerun it at" + (f" (the record was first committed in {added}: its code is "
                                                     "that commit's or older)" if added else ""))
            continue
        changed = changed_since(commit)
        if changed is None:
            out.append(f"code: the record's commit {commit[:8]}{since} is not in this clone")
        elif changed:
            out.append(f"code: the record's commit is {commit[:8]}{since}, this rerun's {str(here.get('commit'))[:8]}"
                       f"{' with uncommitted changes' if here.get('dirty') else ''}: {len(changed)} file(s) under "
                       f"src/ and conf/ differ ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); "
                       f"to rerun at its code: git worktree add <dir> {commit[:8]}, then this command there")
        else:
            out.append(f"code: src/ and conf/ are the record's commit {commit[:8]}'s{since}: not a cause")
        if leg.get("dirty"):
            out.append(f"code: the record's commit {commit[:8]} had uncommitted changes in src/ or conf/ "
                       "(not reproducible from the commit alone)")
    theirs_torch = (res.get("code") or {}).get("torch")
    if theirs_torch and here.get("torch") and theirs_torch != here["torch"]:
        out.append(f"torch: the record's {theirs_torch}, this rerun's {here['torch']}")
    return out
