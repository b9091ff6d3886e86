"""Run a study in one command: its sweep (continuing an interrupted one, skipping finished runs), its
report, and the verdicts of its claims, written to experiments/<name>/.

    normlab-study twt_lowres                   # python -m normlab.commands.study twt_lowres
    normlab-study twt_lowres --jobs 1          # one run at a time (default on a CPU: 2, a core each)
    normlab-study twt_lowres study.budget=smoke   # the machinery in seconds (a test, not a result)
    normlab-study twt_lowres_2k --report-only  # judge and write the README from the records alone
    normlab-study twt_lowres --status          # each planned run's state and the machine-hours left
    normlab-study twt_lowres_2k --verify pre_ln-s1 --steps 50   # rerun a record's first steps: same losses?
    normlab-study twt_lowres trainer.accelerator=gpu   # the same runs on a GPU, one at a time
    normlab-study --list                       # the studies (conf/study/*.yaml)

A study is a file in conf/study/ (normlab.study.spec). Run folders go to studies/runs/ (not in the
repository; named by their identity, so studies that share an arm share its runs); records of
finished runs to experiments/<name>/runs/ (small, committed), and a record whose run identity
matches counts as done, so a study continues on another machine from its committed records; a run
another study recorded is copied from its record (runner.adopt_shared). SIGTERM or Ctrl-C stops
every running job at a checkpoint; the same command continues. Another budget (smoke) writes to
studies/<name>-<budget>/ and never to experiments/.
"""
from __future__ import annotations

import argparse
import gzip
import os
import shlex
import shutil
import sys
from pathlib import Path

from normlab.errors import CommandParser, UserError, report, show_tracebacks, user_error_types

STUDIES = Path("studies")  # a study's run folders and logs (not in the repository)
SHARED_RUNS = STUDIES / "runs"  # one pool of run folders for every full-budget study


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = CommandParser(prog="normlab-study", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="the study (conf/study/<name>.yaml)")
    ap.add_argument("settings", nargs="*", help="study.budget=smoke (or --budget); trainer.accelerator=gpu "
                    "(where the runs train: not part of their identity, so the records are the same runs)")
    ap.add_argument("--budget", default=None, help="full (default) or smoke, or a budget of the study file")
    ap.add_argument("--jobs", type=int, default=None,
                    help="runs at a time, the CPU cores split between them (default: 1 on a GPU; on a "
                         "CPU-only machine one per core, at most 2: measured 1.7x the runs per hour of one "
                         "job on both cores, benchmarks/README.md)")
    ap.add_argument("--out", default=None, help="records, README, plots (default: experiments/<name>)")
    ap.add_argument("--runs", default=None, help="run folders (default: studies/runs, shared by the studies)")
    ap.add_argument("--report-only", action="store_true", help="no training: judge the records and write the README "
                    "(records of the same runs other studies hold are copied in first)")
    ap.add_argument("--status", action="store_true", help="each planned run's state (recorded, finished, training "
                    "now, stopped part-way, failed, not started) and the machine-hours left; runs and writes nothing")
    ap.add_argument("--verify", metavar="RUN", default=None,
                    help="rerun the first --steps optimizer steps of a record (its name, e.g. pre_ln-s1, or its "
                         "folder) at its recorded settings, thread count, kernel path and code (its commit's, "
                         "from git, where this checkout's differ) in a temporary folder, and compare every "
                         "training loss it logged in them to the bit: exit 0 equal, 1 different (with the step, "
                         "both values, and what the rerun could not take from the record)")
    ap.add_argument("--steps", type=int, default=None, help="with --verify: the optimizer steps to rerun "
                    f"(default {VERIFY_STEPS}, or up to the first loss the record logged; its losses logged "
                    "before it are compared)")
    ap.add_argument("--list", action="store_true", help="list the studies")
    args = ap.parse_args(argv)
    if args.steps is not None and args.verify is None:
        raise UserError("--steps", "only with --verify RUN")
    if args.verify is not None and (args.status or args.report_only or args.list):
        raise UserError("--verify", "trains a copy of one record: not with --status, --report-only or --list")
    args.steps = VERIFY_STEPS if args.steps is None else args.steps
    if args.steps < 1:
        raise UserError("--steps", f"{args.steps} must be >= 1")
    args.launch, accelerator = [], "cpu"  # conf/trainer/cpu.yaml: the runs' default
    for item in args.settings:
        key, sep, value = item.partition("=")
        if key in ("study.budget", "budget") and sep:
            args.budget = value
        elif key == "trainer.accelerator" and sep:
            if value not in ACCELERATORS:
                raise UserError("trainer.accelerator", f"{value!r} is not an accelerator", ACCELERATORS)
            args.launch, accelerator = [f"trainer.accelerator={value}"], value
        else:
            raise UserError(item, "not a study setting",
                            ["study.budget=<full|smoke>", f"trainer.accelerator=<{'|'.join(ACCELERATORS)}>"])
    args.budget = "full" if args.budget is None else args.budget  # "" (study.budget=): load_study refuses it
    for flag, value in (("--out", args.out), ("--runs", args.runs)):
        _check_folder(flag, value)
    if args.jobs is None:
        args.jobs = default_jobs(accelerator)
    if args.jobs < 1:
        raise UserError("--jobs", f"{args.jobs} must be >= 1")
    if not args.list and not args.name:
        raise UserError("normlab-study", "name a study (normlab-study --list shows them)")
    return args


def _check_folder(flag: str, value: str | None) -> None:
    """--out or --runs names a folder, or one to make: not empty (that would be the default), not a
    file, not under a file."""
    if value is None:
        return
    if not value:
        raise UserError(flag, "an empty path", "a folder, or no " + flag + " for the default")
    path = Path(value)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise UserError(flag, f"{value} is a file, not a folder" if p == path
                                else f"{value}: {p} is a file, not a folder", "a folder, or a path to make one")
            return


VERIFY_STEPS = 20  # --verify's default: a check in about a minute for a small study's run

# where a study's runs can train: run_config.ACCELERATORS but TPUs (not imported here: it loads torch)
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "auto")


def default_jobs(accelerator: str = "cpu") -> int:
    """Small models use two cores poorly: runs on the CPU train two at a time with a core each, which
    finishes more runs per hour than one run on both cores (benchmarks/study_throughput.py; more than
    2 is not measured). Runs on a GPU take turns on it."""
    import torch

    if accelerator in ("gpu", "cuda", "mps") or (accelerator == "auto" and torch.cuda.is_available()):
        return 1
    return max(1, min(2, os.cpu_count() or 1))


def _status(study, runs: Path, out: Path, records: Path | None) -> int:
    from normlab.study.plan import plan
    from normlab.study.screen_status import screened_status_lines
    from normlab.study.status import status_lines

    if study.kind == "probe":
        print(f"{study.name}: a probe study (measurements at init, no runs to track): "
              f"`normlab-study {study.name}` measures it in one go")
        return 0
    if any(study.screened(a) for a in study.arms.values()):  # each screen, and the seeds waiting for it
        print("\n".join(screened_status_lines(study, runs, out, records)))
        return 0
    print("\n".join(status_lines(study, plan(study, runs, out), records)))
    return 0


def main(argv: list[str] | None = None) -> int:
    from normlab.study.spec import available, load_study

    args = parse(argv)
    if args.list:
        for name in available():
            print(f"{name}: {load_study(name).title}")
        return 0
    study = load_study(args.name, args.budget)
    out, runs, command = _places(study, args)
    if args.verify is not None:
        return _verify(study, args, out)
    if args.status:
        return _status(study, runs, out, records=out.parent if study.budget == "full" and not args.out else None)
    code, jobs = _prepare(study, args, runs, out)
    if code:
        return code
    failed = refused = 0
    if jobs and not args.report_only:
        from normlab.study.runner import Sweep

        sweep = Sweep(study, jobs, runs, parallel=args.jobs, launch=args.launch)
        code = sweep.run()
        if code:
            return code
        failed, refused = len(sweep.failed), len(sweep.refused)
    verdicts = _report(study, args, out, command)
    if jobs:
        _log_verdicts(study, verdicts, jobs, runs)
    if failed:
        print(f"{failed} run(s) failed: see {runs / 'study.log'}; rerun the same command to retry them", file=sys.stderr)
    if refused:
        print(f"{refused} run(s) not run: their results.json is damaged (the warnings above name each file, left as "
              "it is); restore it or move it away, then rerun the same command", file=sys.stderr)
    return 1 if failed or refused else 0


def _places(study, args: argparse.Namespace) -> tuple[Path, Path, str]:
    """(records folder, run folders, the command that reproduces the study): a full-budget study's
    records in experiments/<name>, another budget's under studies/<name>-<budget>/, unless --out /
    --runs say otherwise."""
    base = STUDIES / (study.name if study.budget == "full" else f"{study.name}-{study.budget}")
    out = Path(args.out) if args.out else (Path("experiments") / study.name if study.budget == "full"
                                           else base / "experiment")
    # one pool of run folders for every full-budget study: a run is named by its identity, so two
    # studies that share an arm (the same resolved config) share its runs
    runs = Path(args.runs) if args.runs else (SHARED_RUNS if study.budget == "full" else base / "runs")
    command = "normlab-study " + " ".join(shlex.quote(a) for a in [study.name, *([f"study.budget={study.budget}"]
                                                                               if study.budget != "full" else [])])
    return out, runs, command


def _verify(study, args: argparse.Namespace, out: Path) -> int:
    """--verify RUN: rerun a record's first steps and compare its losses (study/verify.py); a probe
    study records no training to rerun."""
    from normlab.study.spec import available, load_study
    from normlab.study.verify import find_record, verify

    if study.kind == "probe":
        raise UserError("--verify", f"{study.name} is a probe study: it records no training runs",
                        [n for n in available() if load_study(n).kind != "probe"])
    return verify(find_record(out, args.verify), args.steps, args.launch)


def _prepare(study, args: argparse.Namespace, runs: Path, out: Path) -> tuple[int, list]:
    """(exit code, jobs): a probe study measured (unless --report-only), no jobs; a training study's
    screens run first where it has them, then every arm composed and validated into a job before
    anything trains, the test references kept beside the records, and runs other studies recorded
    adopted rather than trained again. A non-zero code: a screen failed, the study stops there."""
    from normlab.study.plan import plan
    from normlab.study.runner import adopt_shared
    from normlab.study.screen_run import choices, run_screens

    if study.kind == "probe":
        from normlab.study.probe import run_probe

        if not args.report_only:
            run_probe(study, out)
        return 0, []
    records = out.parent if study.budget == "full" and not args.out else None  # every study's: experiments/
    if study.screen is not None and not args.report_only:  # each arm's setting first (study/screen.py)
        # other studies' rung records of the same runs: not trained again (screen_run.rung_index)
        code = run_screens(study, runs, out, parallel=args.jobs, launch=args.launch, records=records)
        if code:
            return code, []
    jobs = plan(study, runs, out, choices(study, out))  # every arm composed and validated before anything runs
    _keep_references(jobs, out)
    if records is not None:  # runs other studies recorded: not trained again
        adopt_shared(jobs, records)
    return 0, jobs


def _report(study, args: argparse.Namespace, out: Path, command: str) -> list:
    """Judge the records in `out` and write the study's folder (study/readme.py) and, for the default
    folder of a full study, the index of every claim; print each claim's verdict."""
    from normlab.study.claims import judge, read_refs
    from normlab.study.index import update_index
    from normlab.study.readme import write_study
    from normlab.study.records import load_records
    from normlab.study.screen_outcome import load_screens

    by_arm = load_records(out)
    verdicts = judge(study, by_arm, read_refs(out / "test.ref.gz"), load_screens(study, out))
    readme = write_study(study, by_arm, verdicts, out, command)
    if study.budget == "full" and not args.out:
        update_index(Path("experiments") / "README.md")
    print(f"{readme}:")
    for v in verdicts:
        print(f"  {v.verdict:>12}  {v.claim.id}")
    return verdicts


def _log_verdicts(study, verdicts: list, jobs: list, runs: Path) -> None:
    """The verdict table beside the runs in W&B, where the runs log to it (study/dashboard.py). The
    README and records are written by then: a W&B failure is one warning line, never a traceback."""
    from normlab.study.dashboard import log_verdicts
    from normlab.study.plan import compose

    try:
        note = log_verdicts(study, verdicts, compose([*jobs[0].overrides, *jobs[0].labels]), runs)
    except Exception as e:  # noqa: BLE001 (any W&B error: one line)
        note = f"warning: the verdict table was not logged to W&B: {type(e).__name__}: {e}".splitlines()[0]
    if note:
        print(note)


def _keep_references(jobs, out: Path) -> None:
    """The test references the runs are scored against (the bootstrap's), beside the records."""
    from normlab.study.plan import compose

    dst = out / "test.ref.gz"
    if dst.is_file() or not jobs:
        return
    src = compose(jobs[0].overrides).data.get("test_tgt")
    if not src or not Path(src).is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if str(src).endswith(".gz") else open
    with opener(src, "rb") as f, gzip.GzipFile(dst, "wb", mtime=0) as g:
        shutil.copyfileobj(f, g)


def cli() -> None:
    try:
        code = main()
    except user_error_types() as e:
        if show_tracebacks():
            raise
        code = report(e)
    raise SystemExit(code)


if __name__ == "__main__":
    cli()
