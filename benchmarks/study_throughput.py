"""Study throughput: runs per hour with one job at a time on every core against several jobs at once
with the cores split between them (what `normlab-study NAME --jobs N` does), in one run.

Each run is a real `python -m normlab.commands.train` process (start-up, training, a validation with
BLEU, the final test decode) at a study's model, shortened to --steps steps and --decode-batches
batches of each decode. The two ways take turns (sequential, parallel, sequential, ...) for
--rounds rounds, so load that changes during the measurement hits both; the table gives each
way's runs per hour (median over rounds) and the ratio parallel / sequential of adjacent rounds.

    python benchmarks/study_throughput.py                           # deep_bleu's model (12+12, d 64)
    python benchmarks/study_throughput.py --model default           # the CPU default (3+3, d 128)
    python benchmarks/study_throughput.py --steps 20 --rounds 1     # a quick check of the script
Nothing else may run on the machine meanwhile (see benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The models of the shipped BLEU studies (conf/study/*.yaml): their `common` overrides.
MODELS = {
    "deep_bleu": ["+arm=pre_ln", "model.d_model=64", "model.encoder_ffn=256", "model.decoder_ffn=256",
                  "model.encoder_layers=12", "model.decoder_layers=12"],
    "layerdrop_prune": ["model.encoder_layers=6", "model.decoder_layers=6"],
    "default": [],  # twt_lowres, twt_scalenorm, drophead: the CPU default, 3+3, d 128
}


def command(model: str, steps: int, decode_batches: int, seed: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "normlab.commands.train", *MODELS[model], f"seed={seed}",
            f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
            f"trainer.limit_val_batches={decode_batches}", f"+trainer.limit_test_batches={decode_batches}",
            "eval.test_greedy=false", "eval.test_average=false", "logger=csv",
            f"hydra.run.dir={run_dir}"]


def one_round(args, way: str, jobs: int, tmp: Path, r: int) -> float:
    """Wall seconds for args.runs runs, `jobs` at a time, each with cores // jobs threads."""
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    todo = [command(args.model, args.steps, args.decode_batches, seed, tmp / f"{way}-r{r}-s{seed}")
            for seed in range(1, args.runs + 1)]
    running: list[subprocess.Popen] = []
    t0 = time.perf_counter()
    while todo or running:
        while todo and len(running) < jobs:
            running.append(subprocess.Popen(todo.pop(0), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        time.sleep(0.2)
        for p in [p for p in running if p.poll() is not None]:
            running.remove(p)
            if p.returncode != 0:
                raise SystemExit(f"error: a run failed (exit {p.returncode}): {' '.join(p.args)}")
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="deep_bleu")
    ap.add_argument("--steps", type=int, default=200, help="training steps per run")
    ap.add_argument("--decode-batches", type=int, default=4, help="batches of the valid and test decodes")
    ap.add_argument("--runs", type=int, default=2, help="runs per round (a multiple of --jobs)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time in the parallel way")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    seq, par, ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="study_tp.") as tmp:
        for r in range(args.rounds):
            s = one_round(args, "seq", 1, Path(tmp), r)
            p = one_round(args, "par", args.jobs, Path(tmp), r)
            seq.append(3600 * args.runs / s)
            par.append(3600 * args.runs / p)
            ratios.append(s / p)
            print(f"round {r + 1}: one at a time {s:.1f} s, {args.jobs} at a time {p:.1f} s "
                  f"for {args.runs} runs of {args.steps} steps (ratio {s / p:.2f})", flush=True)
    out = {"model": args.model, "steps": args.steps, "runs": args.runs, "jobs": args.jobs,
           "cores": os.cpu_count(), "machine": platform.machine(),
           "runs_per_hour_sequential": statistics.median(seq), "runs_per_hour_parallel": statistics.median(par),
           "ratio_median": statistics.median(ratios), "ratios": [round(x, 3) for x in ratios]}
    print(f"\n| model | steps | one at a time, {os.cpu_count()} threads (runs/h) | {args.jobs} at a time, "
          f"{max(1, (os.cpu_count() or 1) // args.jobs)} thread(s) each (runs/h) | ratio (median, range) |")
    print("|---|---|---|---|---|")
    print(f"| {args.model} | {args.steps} | {out['runs_per_hour_sequential']:.1f} | "
          f"{out['runs_per_hour_parallel']:.1f} | {out['ratio_median']:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
