"""The prepared GPU check (issue 36): one command, at most 8 minutes on one GPU, whose report can be
pasted into benchmarks/README.md as it is.

    bash benchmarks/gpu_check.sh                      # the check: needs CUDA (one line and exit 2 without)
    bash benchmarks/gpu_check.sh --dry-run            # the same code path on CPU, tiny sizes (CI; < 1 min)
    bash benchmarks/gpu_check.sh --parts device,peers # some parts only
    python benchmarks/gpu_parts.py speed --dry-run --result speed.md  # one part, in this process (debugging)

Parts (gpu_parts.py, gpu_train.py, gpu_speed.py): a. the device, and the SDPA kernel each of the model's attentions
runs; b. `train.py trainer=gpu` (bf16-mixed, fused Adam) on make train's model and on deep_bleu's 12+12,
d 64 model: tokens/s and the allocator's peak; c. fused against foreach and for-loop Adam, and
torch.compile against eager (compile time apart); d. bf16-mixed against fp32: the training loss after
200 steps, same seed and batches; e. normlab against the peers of train_throughput.py, in turns.

Each part runs in its own process under its own time cap (the cap and what is left of --budget, the
smaller), so a part that fails, hangs or breaks its CUDA context is reported (exit status or timeout,
the last lines of its log) and the next part still runs. The report goes to stdout and, rewritten
after every part, to $OUT/gpu_check.out when OUT is set, else benchmarks/gpu_check.out; the parts'
own output (Lightning, train_throughput.py's tables) to the .log beside it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from normlab.errors import CommandParser, UserError, report as report_error  # noqa: E402

BUDGET_S = 480  # the 8 minutes, counted from this script's start
SERVER_S = 120  # at most for the parts' imports (seconds on 2 loaded cores; a hang is a broken install)


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    cap_s: int      # seconds on the GPU
    dry_cap_s: int  # --dry-run


PARTS = (
    Part("device", "a. Device, and the SDPA kernel of each attention", 40, 40),
    Part("train", "b. Training with `train.py trainer=gpu`: tokens/s and peak memory", 120, 60),
    Part("speed", "c. Fused Adam, and torch.compile", 120, 60),
    Part("precision", "d. bf16-mixed against fp32: the training loss after 200 steps", 75, 60),
    Part("peers", "e. normlab against its peers (train_throughput.py), in turns", 90, 60),
)
NAMES = tuple(p.name for p in PARTS)


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.out" if out else ROOT / "benchmarks" / "gpu_check.out"


def parse(argv) -> tuple:
    ap = CommandParser(prog="benchmarks/gpu_check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, 2-3 steps a part: checks the script")
    ap.add_argument("--parts", default=",".join(NAMES), help=f"comma-separated, of {', '.join(NAMES)}")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all parts, from the start")
    ap.add_argument("--out", type=Path, default=None, help="the report file (default $OUT/gpu_check.out, "
                                                            "else benchmarks/gpu_check.out)")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in NAMES]
    if bad or not parts:
        raise UserError("--parts", f"{', '.join(bad) or 'none given'}", NAMES)
    if args.budget <= 0:
        raise UserError("--budget", f"{args.budget:g}: must be > 0 seconds")
    return args, [p for p in PARTS if p.name in parts]


def require_cuda() -> None:
    """The check itself needs a CUDA device; say so in one line before anything runs."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("device", f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is false): "
                                  "the GPU check needs one", "--dry-run on CPU")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), *args], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def header(dry: bool, argv: list[str], budget: float) -> list[str]:
    commit = _git("rev-parse", "--short", "HEAD") if (ROOT / ".git").exists() else None
    dirty = _git("status", "--porcelain", "--", "src", "conf", "benchmarks") if commit else None
    lines = ["## GPU check (`benchmarks/gpu_check.sh`)", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit "
             f"{commit or 'unknown (not a git checkout)'}{' with uncommitted changes' if dirty else ''}, "
             f"`bash benchmarks/gpu_check.sh{''.join(' ' + a for a in argv)}`, budget {budget:.0f} s; every number "
             "below is from this one run (the machine: part a)."]
    if dry:
        lines += ["", "**DRY RUN**: CPU, tiny sizes, 2-3 steps a part. The layout is the check's; the numbers "
                      "mean nothing."]
    return lines


def run_part(ctx, target, args: tuple, cap_s: float) -> tuple[str, float]:
    """`target(*args)` in a process of `ctx` for at most `cap_s` seconds: ("ok" | "exit N" | "timeout",
    seconds). The part puts itself in its own process group (`isolate`), so a timeout ends what it
    started too (inductor's compile workers): SIGTERM, 5 s, then SIGKILL."""
    t0 = time.monotonic()
    proc = ctx.Process(target=target, args=args)
    proc.start()
    proc.join(cap_s)
    if proc.exitcode is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:  # not yet its own group leader: the process alone
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)
            proc.join(5)
            if proc.exitcode is not None:
                break
        proc.join()
        return "timeout", time.monotonic() - t0
    return ("ok" if proc.exitcode == 0 else f"exit {proc.exitcode}"), time.monotonic() - t0


def log_tail(path: Path, start: int, n: int = 6) -> list[str]:
    """The last `n` non-empty lines a part wrote to the log (from byte `start`)."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode("utf-8", "replace")
    return [line.rstrip() for line in text.splitlines() if line.strip()][-n:]


def section(part: Part, status: str, seconds: float, cap: float, body: list[str], tail: list[str]) -> list[str]:
    what = {"ok": "ok", "timeout": "TIMED OUT at its cap"}.get(status, f"FAILED, {status}")
    lines = ["", f"### {part.title} ({what}: {seconds:.1f} s of {cap:.0f} s)"]
    while body and not body[0].strip():
        body = body[1:]
    lines += [""] + body if body else []
    if status != "ok":
        lines += ["", "The part's log ended with:", "```", *tail, "```"]
    return lines


def run_all(parts: list[Part], dry: bool, budget: float, started: float, report: "Report", ctx, target) -> dict:
    """Each part in turn, `target(name, result, work, dry, log)` in a process of `ctx`, under min(its
    cap, the budget left); `report` gets each section as the part ends. The parts' statuses."""
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    statuses = {}
    try:
        for part in parts:
            left = budget - (time.monotonic() - started)
            cap = min(part.dry_cap_s if dry else part.cap_s, left)
            if left < 5:  # too little to start a part and report it
                statuses[part.name] = "skipped"
                report(["", f"### {part.title} (NOT RUN: {max(left, 0):.0f} s of the {budget:.0f} s budget left)"])
                continue
            result, log = work / f"{part.name}.md", report.log_path
            start = log.stat().st_size
            with open(log, "a", encoding="utf-8") as f:
                f.write(f"\n===== {part.name} (cap {cap:.0f} s) =====\n")
            status, seconds = run_part(ctx, target, (part.name, str(result), str(work), dry, str(log)), cap)
            body = result.read_text(encoding="utf-8").splitlines() if result.exists() else []
            statuses[part.name] = status
            report(section(part, status, seconds, cap, body, log_tail(log, start) if status != "ok" else []))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return statuses


def part_processes():
    """Processes forked from a server that has imported torch, Lightning and the parts once (and never
    touched CUDA, so each part initialises its own: forkserver is one of the two start methods torch
    supports with CUDA): a part starts at once instead of spending the imports (~10 s on 2 loaded
    cores) again. The server starts now, so its imports count before the first part's cap."""
    import multiprocessing

    # torch.cuda.is_available() initialises the CUDA driver unless told to ask NVML, and a process
    # forked after that cannot use CUDA: nothing in the server may ask it that way
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["gpu_parts", "gpu_train", "gpu_speed", "train_throughput", "normlab.train", "hydra"])
    warm = ctx.Process(target=ready)
    warm.start()
    warm.join(SERVER_S)
    if warm.exitcode != 0:
        warm.kill()
        raise RuntimeError(f"the parts' server did not start in {SERVER_S} s (its imports): see the log")
    return ctx, child


def ready() -> None:
    """The first process of the parts' server: once it ends, the server's imports are done."""


def isolate(log: str) -> None:
    """In a part's process, first: its own process group (a timeout ends what it started too) and
    its output, C libraries' included, appended to the log."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def child(part: str, result: str, work: str, dry: bool, log: str) -> None:
    isolate(log)
    import gpu_parts

    sys.exit(gpu_parts.main([part, "--result", result, "--work", work, *(["--dry-run"] if dry else [])]))


class Report:
    """Lines to stdout as they come, and the whole report rewritten to `path` each time."""

    def __init__(self, path: Path):
        self.path, self.lines = path, []
        path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = path.with_suffix(".log")
        self.log_path.write_bytes(b"")

    def __call__(self, lines: list[str]) -> None:
        self.lines += lines
        print("\n".join(lines), flush=True)
        self.path.write_text("\n".join(self.lines) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    started = time.monotonic()
    try:
        args, parts = parse(argv)
        if not args.dry_run:
            require_cuda()
    except UserError as e:
        return report_error(e)
    report = Report((args.out or default_out()).resolve())
    os.chdir(ROOT)  # conf/ names the corpus relative to the checkout
    report(header(args.dry_run, argv, args.budget))
    ctx, target = part_processes()
    report(["", f"Imports, once for all parts: {time.monotonic() - started:.1f} s from the start."])
    statuses = run_all(parts, args.dry_run, args.budget, started, report, ctx, target)
    failed = [name for name, s in statuses.items() if s != "ok"]
    report(["", f"{len(statuses) - len(failed)} of {len(statuses)} parts ran to the end"
                + (f"; not: {', '.join(failed)}" if failed else "")
                + f"; {time.monotonic() - started:.0f} s in all. Report: {report.path}; the parts' output: "
                  f"{report.log_path}."])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
