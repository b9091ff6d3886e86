"""torch.compile on CPU at the studies' shapes (issue 36 item 3): is `model.compile=true` worth it per
run, compile time included?

Each measurement is a real `python -m normlab.commands.train` process of a study's model for --steps
training steps (no validation, no final passes), eager and compiled taking turns for --rounds rounds
(so load that changes hits both). From each run's results.json: the training throughput after the
first step (`train_tokens_per_s`: compiled, the first step, which compiles, is excluded by the
counter) and the compile time (`compile_s`: the first step's time). Per run of --budget steps:

    eager run time    = budget x tokens per step / eager tok/s
    compiled run time = compile_s + budget x tokens per step / compiled tok/s
    gain              = eager run time / compiled run time     (the issue's bar: >= 1.2x)

Losses: the compiled model must train like the eager one (tests/test_speed.py checks it to 1e-5 at
tiny size); this script prints both runs' training loss at their last step as a check.

    python benchmarks/compile_study.py                     # deep_bleu's 12+12 d 64 and the 3+3 d 128 default
    python benchmarks/compile_study.py --steps 20 --rounds 1 --models default    # a quick check
Nothing else may run on the machine meanwhile (see benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_throughput import MODELS  # noqa: E402  (the studies' model overrides, one place)

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["eval.test=false", "eval.valid_bleu=false", "++trainer.limit_val_batches=0", "logger=csv",
         "trainer.log_every_n_steps=1", "callbacks.full_checkpoint.every_n_steps=0"]


def one(model: str, compiled: bool, steps: int, root: Path) -> dict:
    run_dir = root / f"{model}-{'compiled' if compiled else 'eager'}-{len(list(root.iterdir()))}"
    cmd = [sys.executable, "-m", "normlab.commands.train", *MODELS[model], *QUIET, f"trainer.max_steps={steps}",
           f"trainer.val_check_interval={steps}", f"model.compile={'true' if compiled else 'false'}",
           f"hydra.run.dir={run_dir}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[3:])}: exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    res = json.loads((run_dir / "results.json").read_text())
    rows = [r for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("train/loss")]
    return {"tok_s": float(res["train_tokens_per_s"]), "compile_s": float(res.get("compile_s") or 0.0),
            "loss": float(rows[-1]["train/loss"])}


# Target tokens per update of the bundled corpus at data.max_tokens 2048, every study's batches
# (docs/results-and-determinism.md, Default settings: about 1,840): weighs the compile time against
# the training time it saves.
TOKENS_PER_STEP = 1840.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="deep_bleu,default")
    ap.add_argument("--steps", type=int, default=100, help="training steps per measured run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2000, help="the study run the gain is amortised over")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"error: --models: {unknown[0]!r} is not a model (allowed: {', '.join(MODELS)})")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"| model | eager tok/s | compiled tok/s | compile s | per {args.budget}-step run: eager / compiled "
              "| loss at the last step (eager, compiled) |")
        print("|---|---:|---:|---:|---:|---|")
        for model in models:
            runs = {False: [], True: []}
            for _ in range(args.rounds):
                for compiled in (False, True):
                    runs[compiled].append(one(model, compiled, args.steps, root))
            eager = statistics.median(r["tok_s"] for r in runs[False])
            comp = statistics.median(r["tok_s"] for r in runs[True])
            compile_s = statistics.median(r["compile_s"] for r in runs[True])
            work = args.budget * TOKENS_PER_STEP
            gain = (work / eager) / (compile_s + work / comp)
            print(f"| {model} | {eager:,.0f} | {comp:,.0f} | {compile_s:.1f} | {gain:.2f}x | "
                  f"{runs[False][-1]['loss']:.4f}, {runs[True][-1]['loss']:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
