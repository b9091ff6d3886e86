"""What a stalled arm costs against a completed one, end to end, and against the code before.

    python benchmarks/stalled_arm.py                       # deep_bleu's post-LN and pre-LN, seed 2 (~30 min)
    python benchmarks/stalled_arm.py --before 4c45ccb      # also the stalled arm with that commit's code
    python benchmarks/stalled_arm.py --steps 20 --arms post_ln --before HEAD --extra eval.test=false eval.valid_bleu=false
                                                           # check the script (a minute)

Issue 21's target: a stalled arm costs at most a quarter of a completed arm's time. Each arm is a
whole `python -m normlab.commands.train` process with a study's exact overrides (conf/study/<study>.yaml:
its common overrides, the arm's, the seed), one after another, `--threads` each (1: as a study job
has with `--jobs 2`); the time is the run's own `wall_s` (results.json). `--before COMMIT` runs the
stalled arm again with that commit's code and that commit's study file (a temporary git worktree on
PYTHONPATH, the same interpreter and packages): the arm as the study ran it then. The arms run one after another, not in turns: keep the machine's load
steady while it runs (the record says what ran beside it) and compare ratios, not seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def arm_overrides(study_name: str, arm: str, seed: int, src: Path = ROOT) -> list[str]:
    """The arm's overrides as checkout `src`'s study file and code give them: a --before commit runs
    the arm as that commit's study ran it (its own common overrides, e.g. without stop_after)."""
    code = ("import json, sys; from normlab.study.spec import load_study; s = load_study(sys.argv[1]); "
            "print(json.dumps(s.arm_overrides(s.arms[sys.argv[2]], int(sys.argv[3]))))")
    res = subprocess.run([sys.executable, "-c", code, study_name, arm, str(seed)], cwd=src, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(src / "src")))
    if res.returncode != 0:
        sys.exit(f"error: {src}: the study {study_name!r} has no arm {arm!r} there "
                 f"({(res.stderr.strip().splitlines() or ['?'])[-1]})")
    return json.loads(res.stdout)


def train(overrides: list[str], run_dir: Path, threads: int, src: Path = ROOT) -> dict:
    """One run in its own process (from checkout `src`: its code and conf/), its results.json."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=str(src / "src"))
    log = run_dir.with_suffix(".log")
    with open(log, "w") as out:
        # retrain: a reused --out trains again (never reports an earlier run's wall time). A --before
        # worktree prepares its own data cache (keyed by the files' paths) inside its run: ~4 s.
        subprocess.run([sys.executable, "-m", "normlab.commands.train", *overrides, f"hydra.run.dir={run_dir}",
                        "group=stalled_arm_bench", "retrain=true"], cwd=src, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)
    return json.loads((run_dir / "results.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--study", default="deep_bleu_2k")
    ap.add_argument("--stalled", default="post_ln", help="the arm that stalls")
    ap.add_argument("--completed", default="pre_ln", help="its twin that trains")
    ap.add_argument("--arms", default="post_ln,pre_ln", help="which of the two to run (a check: one)")
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before", default=None, help="a commit: also the stalled arm with its code")
    ap.add_argument("--steps", type=int, default=None, help="trainer.max_steps for every arm (a check)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every arm (a check: eval.test=false ...)")
    ap.add_argument("--out", default=None, help="run folders (default: a temporary folder)")
    args = ap.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="stalled_arm_"))
    out.mkdir(parents=True, exist_ok=True)
    extra = ([f"trainer.max_steps={args.steps}"] if args.steps else []) + list(args.extra)
    todo = [a for a in args.arms.split(",") if a]
    rows: dict[str, dict] = {}
    for arm in todo:
        rows[arm] = train(arm_overrides(args.study, arm, args.seed) + extra, out / arm, args.threads)
        print(f"{arm}: {rows[arm]['status']}, {rows[arm]['steps']} steps, {rows[arm]['wall_s']} s", flush=True)
    if args.before:
        tree = out / f"before-{args.before}"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.before], check=True,
                       stdout=subprocess.DEVNULL)
        try:
            rows["before"] = train(arm_overrides(args.study, args.stalled, args.seed, src=tree) + extra,
                                   out / f"{args.stalled}-before", args.threads, src=tree)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        print(f"{args.stalled} at {args.before}: {rows['before']['status']}, {rows['before']['wall_s']} s")

    stalled, done, before = rows.get(args.stalled), rows.get(args.completed), rows.get("before")
    print(f"\n{args.study} seed {args.seed}, {args.threads} thread(s) per run, runs in {out}")
    if stalled and done:
        print(f"stalled / completed: {stalled['wall_s']} / {done['wall_s']} s = "
              f"{stalled['wall_s'] / done['wall_s']:.3f} (target <= 0.25)")
    if before and done:
        print(f"before: {before['wall_s']} / {done['wall_s']} s = {before['wall_s'] / done['wall_s']:.3f}")
    if before and stalled:
        print(f"after / before: {stalled['wall_s'] / before['wall_s']:.3f}")


if __name__ == "__main__":
    main()
