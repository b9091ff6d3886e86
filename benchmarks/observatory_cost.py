"""The stability observatory's cost (issue 38 item 4: under 5% of a run when on, nothing when off):
the same short run with `callbacks.observatory.enabled=false` and `=true`, in turns.

    python benchmarks/observatory_cost.py                          # make train's default run, 400 steps, 2 rounds
    python benchmarks/observatory_cost.py --extra trainer=gpu      # on a GPU
    python benchmarks/observatory_cost.py --steps 20 --val-every 10 --rounds 1   # check the script (minutes)

Each run is one whole `python -m normlab.commands.train` process in a fresh folder (`logger=csv`,
no test pass: the observatory does nothing there), with validation every --val-every steps (the
observatory's forward runs at each). The two arms alternate which goes first in each round. Reported
per arm: the process's wall time measured outside it (the run's cost, start-up and validations
included) and results.json's train_tokens_per_s (the training steps alone: what the per-update
gradient norms cost); cost = on / off - 1 of the medians. Measure with nothing else running: timings
on a shared machine are the other jobs' as much as this one's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"off": "callbacks.observatory.enabled=false", "on": "callbacks.observatory.enabled=true"}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not an integer >= 1")
    return value


def one_run(arm: str, args, folder: Path) -> dict:
    overrides = [ARMS[arm], f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.val_every}",
                 "logger=csv", "eval.test=false", "retrain=true", f"++run_dir={folder}",
                 "trainer.enable_progress_bar=false", *args.extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "normlab.commands.train", *overrides], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    results = json.loads((folder / "results.json").read_text())
    if results["status"] != "completed":
        raise SystemExit(f"error: the {arm} run ended {results['status']}")
    return {"wall_s": wall, "train_tokens_per_s": results["train_tokens_per_s"], "device": results.get("device")}


def cost(times: dict[str, list[dict]]) -> dict:
    """Medians per arm, and on / off - 1 of the wall time and of the training time per token."""
    med = {arm: {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "train_tokens_per_s")}
           for arm, rows in times.items()}
    return {"median": med, "run_cost": med["on"]["wall_s"] / med["off"]["wall_s"] - 1,
            "step_cost": med["off"]["train_tokens_per_s"] / med["on"]["train_tokens_per_s"] - 1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=positive, default=400)
    parser.add_argument("--val-every", type=positive, default=100)
    parser.add_argument("--rounds", type=positive, default=2)
    parser.add_argument("--extra", nargs="*", default=[], help="more train.py overrides, for both arms")
    parser.add_argument("--json", type=Path, help="write the timings here too")
    args = parser.parse_args(argv)
    times: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
                times[arm].append(one_run(arm, args, Path(tmp) / f"{arm}{r}"))
                print(f"round {r + 1} {arm}: {times[arm][-1]['wall_s']:.1f} s, "
                      f"{times[arm][-1]['train_tokens_per_s']:.0f} train tokens/s", flush=True)
    out = cost(times)
    print(f"observatory on / off - 1: run {out['run_cost']:+.1%}, training step {out['step_cost']:+.1%} "
          f"({args.steps} steps, a validation every {args.val_every}; {times['on'][0]['device']})")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": times, **out},
                                        indent=1, default=str))


if __name__ == "__main__":
    main()
