"""Check a record by rerunning it: `normlab-study NAME --verify RUN [--steps N]` trains the first N
optimizer steps of the record's run again, at its recorded settings (results.json `study.overrides`),
thread count (`device`), kernel path where this CPU has it (`cpu`) and code (`code_legs`: where this
checkout's src/ or conf/ differ from the record's commit, that commit's, exported from git), into a
temporary folder (never the study's run folders), and compares every training loss the record
logged in those steps (metrics.csv train/loss and train/nll, every trainer.log_every_n_steps) with
the rerun's, to the bit.

The rerun is the run itself, paused: `callbacks.preemption.stop_at_step=N` is not part of the
identity and changes nothing before step N (trainer.max_steps=N would move every schedule read from
it); code from before stop_at_step is paused by its own preemption path (pause_at.py). fp32
training is the same to the bit only for the same code, seed, thread count and CPU kernel path
(hardware.py), so a difference is explained by what the rerun could not take from the record
(verify_why.py): a record that names no code or no CPU (trained before they were recorded), a
commit not in this clone, a kernel path this CPU does not have.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from normlab.errors import UserError
from normlab.study.verify_record import LOSSES, logged_losses, read_results
from normlab.study.verify_why import RerunCode, record_legs, recorded_threads  # noqa: F401 (the tests read them here)

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
        mine = (f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} as set here" if env.get("OMP_NUM_THREADS")
                else "torch's default")
        notes.append("the record names no thread count: rerun with "
                     + (f"{threads} (this machine's cores over its {jobs} jobs)" if threads else mine))
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


def steps_to_compare(theirs: dict[int, dict[str, str]], steps: int, name: str) -> tuple[int, list[str]]:
    """`steps`, or the first step the record logged a loss at if it logged none before (a record logs
    every trainer.log_every_n_steps, 25 in the studies: --steps 20 would compare nothing)."""
    first = min(theirs) + 1  # metrics.csv's step k is the loss of optimizer step k + 1
    if first <= steps:
        return steps, []
    return first, [f"--steps {steps}: {name} logged its first loss at step {first}, so {first}"]


def rerun_code(res: dict, steps: int, dest: Path) -> RerunCode:
    """The record's commit's code where this checkout's src/ or conf/ differ from it (the commit of
    the leg that trained most of the steps), else this checkout's. A record that names no commit, one
    not in this clone or one with uncommitted changes is rerun here (verify_why says what that
    leaves open)."""
    from normlab.provenance import changed_since, export_code

    here = RerunCode([f"callbacks.preemption.stop_at_step={steps}"])  # a pause: not identity, nothing moves
    legs = record_legs(res, steps)
    if not legs or not all(g.get("commit") for g in legs):
        return here
    commit = max(legs, key=lambda g: g["n"])["commit"]
    changed = changed_since(commit)
    # None: not in this clone; []: this checkout runs its code; a commit with uncommitted changes is
    # not the record's code either (this checkout's may be: a record trained from this working tree)
    if not changed or any(g.get("dirty") for g in legs):
        return here
    if not export_code(commit, dest):
        here.notes.append(f"git could not export {commit[:8]}'s src/ and conf/: rerun at this checkout's code")
        return here
    note = (f"at the record's commit {commit[:8]} (its src/ and conf/ from git: this checkout's differ in "
            f"{len(changed)} file(s))")
    if "stop_at_step" in (dest / "conf" / "callbacks" / "preemption.yaml").read_text(errors="replace"):
        return RerunCode(here.pause, commit, dest, notes=[note])
    (dest / "pause").mkdir()
    shutil.copy(Path(__file__).with_name("pause_at.py"), dest / "pause" / "normlab_verify_pause.py")
    return RerunCode(["+callbacks.verify_pause._target_=normlab_verify_pause.PauseAt",
                      f"+callbacks.verify_pause.step={steps}"], commit, dest, by_signal=True,
                     notes=[note + ", paused by SIGTERM after the steps (it has no stop_at_step)"])


def train_command(res: dict, steps: int, run_dir: Path, launch: list[str] = (),
                  pause: list[str] | None = None) -> list[str]:
    """The record's run (its overrides), paused after `steps`, logged to CSV only."""
    overrides = list((res.get("study") or {}).get("overrides") or [])
    pause = [f"callbacks.preemption.stop_at_step={steps}"] if pause is None else pause
    return [sys.executable, "-m", "normlab.commands.train", *overrides, *launch, *pause, "logger=csv",
            f"hydra.run.dir={run_dir}"]


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
    record that cannot be checked (before any work: verify_record.py) or a rerun that failed (its
    folder kept). The temporary folder is removed on every other way out (an error, Ctrl-C)."""
    from normlab.hardware import cpu_info

    res = read_results(record / "results.json")
    if not (record / "metrics.csv").is_file() or not (res.get("study") or {}).get("overrides"):
        raise UserError(f"{record}", "a record without metrics.csv or study.overrides cannot be rerun")
    theirs = logged_losses(record / "metrics.csv")
    if not theirs:
        raise UserError(f"{record}/metrics.csv", "no training loss logged")
    steps, notes = steps_to_compare(theirs, steps, record.name)
    env, env_notes = rerun_env(res, cpu_info())
    run_dir = Path(tempfile.mkdtemp(prefix=f"normlab-verify-{record.name}-"))
    keep = False  # True once a line names the folder: a rerun that differs, or failed (its log)
    try:
        status = _rerun(record, res, theirs, steps, launch, env, (notes, env_notes), run_dir, say)
        keep = status != 0
        return status
    except UserError as e:
        keep = str(run_dir) in str(e)  # a failed rerun's line names its log there; another error (a commit
        raise  # this clone lacks) names nothing in it
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _rerun(record: Path, res: dict, theirs: dict, steps: int, launch: list[str], env: dict,
           notes: tuple[list[str], list[str]], run_dir: Path, say) -> int:
    """The record's first steps trained again in run_dir and compared: 0 equal, 1 not (the folder
    named, for a look); UserError: the rerun failed (its log named)."""
    from normlab.study.verify_why import conclusion, reasons

    code = rerun_code(res, steps, run_dir / "code")
    if code.root is not None:  # the record's own code, not this checkout's (nor the user's PYTHONPATH)
        env["PYTHONPATH"] = os.pathsep.join(str(code.root / d) for d in ("src", "pause") if (code.root / d).is_dir())
    cmd = train_command(res, steps, run_dir / "run", launch, code.pause)
    say(f"rerunning the first {steps} steps of {record} in {run_dir} "
        f"({env.get('OMP_NUM_THREADS', 'default')} thread(s))"
        + "".join(f"; {n}" for n in notes[0] + code.notes + notes[1]))
    with open(run_dir / "train.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    mine = _read_json(run_dir / "run" / "results.json")
    paused = proc.returncode == 0 or (code.by_signal and proc.returncode == 128 + signal.SIGTERM)
    if not paused or mine.get("status") in (None, "failed", "interrupted"):
        tail = (run_dir / "train.log").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise UserError("--verify", f"the rerun failed (exit {proc.returncode}): {tail[0][:200]} "
                                    f"(log: {run_dir / 'train.log'})")
    metrics = run_dir / "run" / "csv" / "metrics.csv"
    verdict = compare(theirs, logged_losses(metrics) if metrics.is_file() else {}, steps)
    if verdict.equal:
        say(verdict.lines[0])
        return 0
    why = reasons(res, mine, steps, record, code)
    for line in verdict.lines + [f"kept: {run_dir}", "why it may differ:"] + [f"  - {r}" for r in why]:
        say(line)
    say(conclusion(res, mine, steps, code))
    return 1


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
