"""What share of a study run goes to scoring: validation BLEU during training, the final valid pass,
the beam test, and the greedy and averaged passes, before and after the cheaper scoring of issue 36.

    python benchmarks/scoring_share.py                              # deep_bleu_2k's pre-LN, 2,000 steps, both
    python benchmarks/scoring_share.py --study deep_bleu --steps 2000  # the screened study's shape (its common lr)
    python benchmarks/scoring_share.py --shape default              # make train's default run (3+3, d 128)
    python benchmarks/scoring_share.py --steps 200 --val-every 100  # check the script (minutes)

Each variant is one whole `python -m normlab.commands.train` process (a study job's), run one after
the other with `--threads` threads each (1: a study job's share at `--jobs 2`), in a fresh folder
(`retrain=true`, `logger=csv`). The process times its own parts (wrappers around normlab's
functions, nothing else changed): each validation from its epoch start to its end, split into the
BLEU part (decoding, evaluation.translate_batches, and sacreBLEU) and the loss part (the rest: the
teacher-forced loss over the whole valid set, gathering, logging); each final pass
(final_test.evaluation_pass: valid, test, test_greedy, test_avg) likewise, and the checkpoint
averaging before the averaged pass; Trainer.fit. The run's wall time is the process's, measured
outside it. Training = fit minus its validations; other = start-up, data, the run folder, loggers.
Scoring = validation BLEU + every final pass (the validation loss is reported beside it: the stall
guard, the plateau stop and the study's curves read it).

Variants: `before` scores as make train does by default: the study's overrides and the arm's, the
seed, without the study's scoring keys (SCORING_KEYS: no subset, the |src| + 50 cap, the greedy and
averaged passes on); `after` adds `eval.valid_subset=--subset`, the length cap `--cap` on both
decoders, and `eval.test_greedy=false` / `eval.test_average=false` for each pass whose metrics the
study reads nowhere (normlab.study.passes; the default shape reads none). Measure with nothing else
running: timings on a shared machine are the other jobs' as much as this one's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FINAL = ("final valid", "final test", "final test_greedy", "final test_avg")
# the keys `before` drops from a study's overrides and `after` sets: the cheap scoring's opt-ins
SCORING_KEYS = ("eval.valid_subset", "eval.decoder.max_len_a", "eval.decoder.max_len_b", "eval.test_decoder.max_len_a",
                "eval.test_decoder.max_len_b", "eval.test_greedy", "eval.test_average")
PASS_METRICS = {"eval.test_greedy": ("test_bleu_greedy", "test_chrf_greedy"),
                "eval.test_average": tuple(f"test_{m}_avg" for m in ("bleu", "chrf", "loss", "nll", "ppl"))}


# ---- the child: one run, timed from inside ------------------------------------------------------
class Clock:
    """Seconds by phase (a validation, a final pass) and part (total, decode, bleu); decoding and
    sacreBLEU count to the innermost open phase."""

    def __init__(self):
        self.open: list[tuple[str, float]] = []
        self.parts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.order: list[str] = []

    def start(self, phase: str) -> None:
        if phase not in self.parts:
            self.order.append(phase)
        self.open.append((phase, time.perf_counter()))

    def stop(self) -> None:
        phase, t0 = self.open.pop()
        self.parts[phase]["total"] += time.perf_counter() - t0

    def timed(self, part: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.open:
                    self.parts[self.open[-1][0]][part] += time.perf_counter() - t0
        return wrapper

    def phase(self, name_of, fn):
        def wrapper(*args, **kwargs):
            self.start(name_of(*args, **kwargs))
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop()
        return wrapper


def instrument(clock: Clock) -> None:
    import lightning as L

    import normlab.final_test as ft
    import normlab.lit_module as lit

    M = lit.Seq2SeqModule
    start, end = M.on_validation_epoch_start, M.on_validation_epoch_end

    def epoch_start(self):
        clock.start(f"validation {self.global_step}")
        start(self)

    def epoch_end(self):
        try:
            end(self)
        finally:
            clock.stop()

    M.on_validation_epoch_start, M.on_validation_epoch_end = epoch_start, epoch_end
    lit.translate_batches = clock.timed("decode", lit.translate_batches)  # validation's and the final passes'
    lit.score = clock.timed("bleu", lit.score)
    ft.evaluation_pass = clock.phase(
        lambda out, trainer, module, dm, split, ckpt, suffix="", **_: f"final {split}{suffix}", ft.evaluation_pass)
    ft._averaged_test = clock.phase(lambda *a, **k: "averaging", ft._averaged_test)  # holds the test_avg pass
    L.Trainer.fit = clock.phase(lambda *a, **k: "fit", L.Trainer.fit)


def child(out: str, overrides: list[str]) -> int:
    clock = Clock()
    instrument(clock)
    from normlab.commands.train import main

    code = main(overrides)
    Path(out).write_text(json.dumps({"status": code, "order": clock.order,
                                     "parts": {k: dict(v) for k, v in clock.parts.items()}}))
    return code


# ---- the parent: variants, table ----------------------------------------------------------------
def shape_overrides(args, ap) -> tuple[list[str], set[str]]:
    """(the run's overrides without SCORING_KEYS, the metrics its study reads: none for the default run)."""
    if args.shape == "default":
        return [f"seed={args.seed}"], set()
    sys.path.insert(0, str(ROOT / "src"))
    from normlab.errors import UserError
    from normlab.study.passes import metrics_read
    from normlab.study.spec import load_study

    try:
        study = load_study(args.study)
    except UserError as e:
        ap.error(f"--study: {e}")
    if args.arm not in study.arms:
        ap.error(f"--arm {args.arm}: not an arm of {args.study} (allowed: {', '.join(study.arms)})")
    over = study.arm_overrides(study.arms[args.arm], args.seed)
    return [o for o in over if o.split("=", 1)[0].lstrip("+") not in SCORING_KEYS], metrics_read(study)


def variant_overrides(name: str, args, read: set[str] = frozenset()) -> list[str]:
    """`before`: nothing more (every pass, as make train scores); `after`: the subset, the cap, and off
    every extra pass none of whose metrics is in `read`."""
    if name == "before":
        return []
    a, b = args.cap.split(",")
    out = [f"eval.valid_subset={args.subset}"] if args.subset else []
    out += [f"eval.{d}.max_len_{k}={v}" for d in ("decoder", "test_decoder") for k, v in (("a", a), ("b", b))]
    return out + [f"{key}=false" for key, metrics in PASS_METRICS.items() if not read.intersection(metrics)]


def run_variant(name: str, overrides: list[str], out: Path, threads: int) -> dict:
    run_dir, timings = out / name, out / f"{name}.timings.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, __file__, "--child", str(timings), "--", *overrides, f"hydra.run.dir={run_dir}",
           "retrain=true", "logger=csv", "group=scoring_share_bench"]
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not timings.is_file():
        sys.exit(f"error: the {name} run failed (exit {proc.returncode}): see {out / f'{name}.log'}")
    t = json.loads(timings.read_text())
    results = json.loads((run_dir / "results.json").read_text())
    return {"wall_s": wall, "overrides": overrides, "timings": t, "results": {
        k: results.get(k) for k in ("status", "steps", "wall_s", "valid_bleu", "test_bleu", "checkpoint")}}


def table(v: dict) -> tuple[list[tuple[str, float]], dict[str, float]]:
    """(rows: (what, seconds)), shares of the run) from one variant's timings."""
    p, wall = v["timings"]["parts"], v["wall_s"]
    get = lambda k, part="total": p.get(k, {}).get(part, 0.0)  # noqa: E731
    vals = [k for k in v["timings"]["order"] if k.startswith("validation ")]
    v_bleu = sum(get(k, "decode") + get(k, "bleu") for k in vals)
    v_all = sum(get(k) for k in vals)
    finals = {k: get(k) for k in FINAL if k in p}
    averaging = get("averaging") - get("final test_avg")
    rows = [("training steps (fit minus its validations)", get("fit") - v_all),
            (f"validation loss ({len(vals)} validations, whole set)", v_all - v_bleu),
            (f"validation BLEU ({len(vals)} validations: decode + sacreBLEU)", v_bleu)]
    rows += [(f"{k} (decode + sacreBLEU {get(k, 'decode') + get(k, 'bleu'):.1f} s)", s) for k, s in finals.items()]
    if "averaging" in p:
        rows.append(("checkpoint averaging (before final test_avg)", averaging))
    other = wall - get("fit") - sum(finals.values()) - max(averaging, 0.0)
    rows.append(("other (start-up, data, run folder, loggers)", other))
    scoring = v_bleu + sum(finals.values()) + max(averaging, 0.0)
    shares = {"scoring": scoring / wall, "validation_loss": (v_all - v_bleu) / wall, "wall_s": wall,
              "scoring_s": scoring}
    return rows, shares


def report(name: str, v: dict) -> dict:
    rows, shares = table(v)
    r = v["results"]
    print(f"\n{name}: {' '.join(v['overrides']) or '(every pass, the whole valid set, the |src| + 50 cap)'}")
    print(f"  status {r['status']}, {r['steps']} steps, valid BLEU {r['valid_bleu']}, test BLEU {r['test_bleu']}; "
          f"process {v['wall_s']:.1f} s (results.json wall_s {r['wall_s']})")
    for what, s in rows:
        print(f"  {what:<62} {s:8.1f} s  {s / v['wall_s']:6.1%}")
    p = v["timings"]["parts"]
    for k in (k for k in v["timings"]["order"] if k.startswith("validation ")):
        bleu = p[k].get("decode", 0.0) + p[k].get("bleu", 0.0)
        print(f"    {k}: {p[k]['total']:.1f} s (loss part {p[k]['total'] - bleu:.1f} s, BLEU part {bleu:.1f} s)")
    print(f"  scoring: {shares['scoring_s']:.1f} s = {shares['scoring']:.1%} of the run (target <= 10%); "
          f"validation loss {shares['validation_loss']:.1%}")
    return {**v, "rows": rows, "shares": shares}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="deep_bleu_2k", help="the study whose run shape is measured")
    ap.add_argument("--arm", default="pre_ln")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shape", choices=("study", "default"), default="study",
                    help="study: --study's --arm; default: make train's run")
    ap.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: the run's, 2,000)")
    ap.add_argument("--val-every", type=int, default=None, help="trainer.val_check_interval (default: the run's)")
    ap.add_argument("--subset", type=int, default=200, help="after: eval.valid_subset (0: none)")
    ap.add_argument("--cap", default="1.2,10", help="after: max_len_a,max_len_b of both decoders")
    ap.add_argument("--variants", default="before,after")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every variant")
    ap.add_argument("--out", default=None, help="run folders and logs (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="also write every number here")
    args = ap.parse_args(argv)
    cap = args.cap.split(",")
    if len(cap) != 2 or not cap[0].replace(".", "", 1).isdigit() or not cap[1].isdigit():
        ap.error(f"--cap {args.cap!r}: max_len_a,max_len_b, a number >= 0 and an integer >= 0 (e.g. 1.2,10)")
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in ("before", "after") for v in variants):
        ap.error(f"--variants {args.variants!r}: a comma-separated list of before, after")
    shape, read = shape_overrides(args, ap)
    base = shape + ([f"trainer.max_steps={args.steps}"] if args.steps else []) \
        + ([f"trainer.val_check_interval={args.val_every}"] if args.val_every else []) + list(args.extra)
    out = Path(args.out or tempfile.mkdtemp(prefix="scoring_share_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.shape if args.shape == 'default' else f'{args.study} {args.arm}'} seed {args.seed}, "
          f"{args.threads} thread(s) a run, folders in {out}\nrun: {' '.join(base)}", flush=True)
    done = {}
    for name in variants:
        extra = variant_overrides(name, args, read)
        done[name] = report(name, run_variant(name, base + extra, out, args.threads) | {"overrides": extra})
    if args.json:
        Path(args.json).write_text(json.dumps({"base": base, "threads": args.threads, "variants": done}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
