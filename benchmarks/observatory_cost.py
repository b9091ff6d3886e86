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

Inside the on run, the observatory's own time: each process runs train through this file (`--child`),
which wraps the Observatory callback's three hooks in a timer (on a GPU a pair of CUDA events around
each call, read after the run: no host sync added to the run); observatory share = those seconds /
the run's wall time measured outside it (start-up included), per run. It is a ratio within one process, so it holds when the between-run comparison is
lost in the machine's noise (a 5% cost cannot be told from two runs ~10% apart): that is the number the
issue's target is checked against. The wrapper is the same for both arms (the off run builds no
Observatory, so its timer reads 0).
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


HOOKS = {"on_before_optimizer_step": "step", "on_train_batch_end": "step", "on_validation_batch_start": "validation"}


def timed_hooks(cls, totals: dict[str, float]) -> list:
    """Wrap `cls`'s HOOKS so each call adds its seconds to totals[kind] ("step" or "validation"). On a
    GPU each call is timed by a pair of CUDA events instead (no host sync, which would stall only the on
    run's pipeline): the pairs are returned, read by `gpu_seconds` after the run."""
    import torch

    events: list = []

    def wrap(method, kind):
        def hook(*args, **kwargs):
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return method(*args, **kwargs)
                finally:
                    end.record()
                    events.append((kind, start, end))
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[kind] = totals.get(kind, 0.0) + time.perf_counter() - t0
        return hook

    for name, kind in HOOKS.items():
        setattr(cls, name, wrap(getattr(cls, name), kind))
    return events


def gpu_seconds(events: list, totals: dict[str, float]) -> None:
    """Add the CUDA event pairs' times (one sync, after the run) to totals."""
    if events:
        import torch

        torch.cuda.synchronize()
        for kind, start, end in events:
            totals[kind] = totals.get(kind, 0.0) + start.elapsed_time(end) / 1000


def child(out: str, overrides: list[str]) -> int:
    """One train process with the observatory's hooks timed; their seconds to `out` (json)."""
    from normlab.callbacks.observatory import Observatory
    from normlab.commands.train import main as train

    totals = {"step": 0.0, "validation": 0.0}
    events = timed_hooks(Observatory, totals)
    code = train(overrides)
    gpu_seconds(events, totals)
    Path(out).write_text(json.dumps(totals))
    return code


def one_run(arm: str, args, folder: Path) -> dict:
    overrides = [ARMS[arm], f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.val_every}",
                 "logger=csv", "eval.test=false", "retrain=true", f"++run_dir={folder}",
                 "trainer.enable_progress_bar=false", *args.extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    seconds = folder.with_name(folder.name + ".observatory.json")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--child", str(seconds), *overrides], cwd=ROOT, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    results = json.loads((folder / "results.json").read_text())
    if results["status"] != "completed":
        raise SystemExit(f"error: the {arm} run ended {results['status']}")
    hooks = json.loads(seconds.read_text())
    return {"wall_s": wall, "train_tokens_per_s": results["train_tokens_per_s"], "device": results.get("device"),
            "observatory_s": hooks, "observatory_share": sum(hooks.values()) / wall}


def cost(times: dict[str, list[dict]]) -> dict:
    """Medians per arm, and on / off - 1 of the wall time and of the training time per token."""
    med = {arm: {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "train_tokens_per_s")}
           for arm, rows in times.items()}
    out = {"median": med, "run_cost": med["on"]["wall_s"] / med["off"]["wall_s"] - 1,
           "step_cost": med["off"]["train_tokens_per_s"] / med["on"]["train_tokens_per_s"] - 1}
    if all("observatory_share" in r for r in times["on"]):  # the hooks' own seconds, inside each on run
        out["observatory_share"] = statistics.median(r["observatory_share"] for r in times["on"])
        out["observatory_s"] = {kind: statistics.median(r["observatory_s"][kind] for r in times["on"])
                                for kind in ("step", "validation")}
    return out


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
                run = times[arm][-1]
                print(f"round {r + 1} {arm}: {run['wall_s']:.1f} s, {run['train_tokens_per_s']:.0f} train tokens/s, "
                      f"observatory {run['observatory_share']:.2%} of it", flush=True)
    out = cost(times)
    print(f"observatory on / off - 1: run {out['run_cost']:+.1%}, training step {out['step_cost']:+.1%} "
          f"({args.steps} steps, a validation every {args.val_every}; {times['on'][0]['device']})")
    hooks = out["observatory_s"]
    print(f"inside the on run: the observatory's hooks {out['observatory_share']:.2%} of the run's wall time "
          f"({hooks['step']:.2f} s in the training steps, {hooks['validation']:.2f} s at the validations; medians)")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": times, **out},
                                        indent=1, default=str))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # one train process, the observatory timed (one_run starts it)
        raise SystemExit(child(sys.argv[2], sys.argv[3:]))
    main()
