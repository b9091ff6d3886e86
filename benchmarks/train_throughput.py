"""Training throughput of normlab against x-transformers and torch.nn.Transformer, in one run.

Five settings (the papers' regularisation, dropout 0.1 everywhere, none; and the model alone at the
papers' dropout and at none: normlab too on full logits and torch's label-smoothed cross-entropy)
x three models at one shape (peers.py), the same batches for all, a full step each (forward,
label-smoothed loss, backward, Adam). The models take turns step by step (in alternating order)
for --rounds rounds of --steps batches, so machine load hits them alike; that comparison is
repeated --repeats times in the same process. Per setting and repeat, normlab / model is the median
over steps of the ratio of normlab's step to the other model's adjacent step (robust to load that
changes during the run) and normlab / fastest peer the smallest of those; the table gives its median
[min, max] over the repeats, and per model target tokens/s per step (min / median / max over all
repeats), MFU against the fp32 matmul peak measured at the start of the same run and peak memory of
one step. Then the Lightning loop's overhead over a plain PyTorch loop on the same model and batches
(lightning_overhead.py).

    python benchmarks/train_throughput.py --threads 2 --json bench.json   # the record: CPU, all settings
    python benchmarks/train_throughput.py --shape tiny                    # make train's model (3+3, d 128, pre-norm)
    python benchmarks/train_throughput.py --device cuda --bf16    # GPU: bf16 autocast, fused Adam
    python benchmarks/train_throughput.py --small --steps 2 --rounds 1 --repeats 1   # a quick check of the script
    python benchmarks/train_throughput.py --compile               # normlab under torch.compile
x-transformers: `pip install -e ".[bench]"` (skipped if absent).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import normlab  # noqa: F401,E402  (sets OMP_WAIT_POLICY before torch loads)
import torch  # noqa: E402

import peers as P  # noqa: E402


def build(settings, names, shape, device, compile):
    """The runs (a model and its optimizer each) and, per setting, its runs, normlab first. A peer is
    the same in a model-alone setting as in its dropout setting: one run serves both."""
    runs, by_setting = {}, {}
    for setting in settings:
        by_setting[setting] = []
        for cls in (*P.PEERS, *P.VARIANTS):
            if cls.name not in names:
                continue
            full = issubclass(cls, P.Normlab) and setting in P.MODEL_ALONE
            key = (cls.name, P.MODEL_ALONE.get(setting, setting), full)
            if key not in runs:
                torch.manual_seed(0)
                try:
                    peer = P.build(cls, shape, setting, compile=compile and issubclass(cls, P.Normlab))
                except ImportError as e:
                    print(f"{cls.name}: skipped ({e}; pip install -e '.[bench]')")
                    continue
                peer.model.to(device).train()
                runs[key] = {"name": cls.name, "peer": peer, "opt": P.adam(peer.model.parameters(), device),
                             "tok_s": [], "params": sum(p.numel() for p in peer.model.parameters())}
            by_setting[setting].append(runs[key])
    # Turn order: each dropout setting's runs together, normlab on full logits (the model alone)
    # right after its peers, so a model-alone ratio pairs steps taken next to each other, as the
    # other ratios do (it was 7-8 steps away, after every setting's runs); a variant of normlab's
    # right before normlab, and its full-logits run right after normlab's, so normlab stays next to
    # its peers and next to the variant.
    group = {base: i for i, base in enumerate(dict.fromkeys(k[1] for k in runs))}
    variants = {c.name for c in P.VARIANTS}

    def place(k):  # (dropout setting, full logits, then variants / normlab / peers)
        rank = (0 if k[0] in variants else 1 if k[0] == "normlab" else 2) if not k[2] else int(k[0] != "normlab")
        return group[k[1]], k[2], rank
    order = sorted(runs, key=place)
    return [runs[k] for k in order], by_setting


def compare(rows: list[dict], repeat: int) -> dict:
    """One repeat of one setting: normlab / model (the median over steps of adjacent-step ratios) per
    peer, and normlab / fastest peer, the smallest of them (nan without normlab or a peer)."""
    ours = next((r["tok_s"][repeat] for r in rows if r["name"] == "normlab"), None)
    ratios = {r["name"]: P.quantiles([a / b for a, b in zip(ours, r["tok_s"][repeat])])[1] if ours else float("nan")
              for r in rows}
    variants = {c.name for c in P.VARIANTS}
    peers = {k: v for k, v in ratios.items() if k != "normlab" and k not in variants}
    fastest = min(peers, key=peers.get) if peers and ours else None
    out = {"tok_s": {r["name"]: r["tok_s"][repeat] for r in rows}, "normlab_over_model": ratios,
           "fastest_peer": fastest, "normlab_over_fastest": peers[fastest] if fastest else float("nan")}
    for r in rows:  # a variant of normlab's against the same fastest peer, step for step
        if r["name"] in variants and fastest:
            theirs = out["tok_s"][fastest]
            out[f"{r['name']}_over_fastest"] = P.quantiles([a / b for a, b in zip(r["tok_s"][repeat], theirs)])[1]
    return out


def spread(xs: list[float]) -> dict:
    lo, med, hi = P.quantiles(xs)
    return {"median": med, "min": lo, "max": hi, "values": xs}


def fmt_spread(x: dict) -> str:
    return f"{x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}]"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=",".join((*P.SETTINGS, *P.MODEL_ALONE)))
    ap.add_argument("--models", default=",".join(c.name for c in P.PEERS),
                    help=f"of {', '.join(c.name for c in (*P.PEERS, *P.VARIANTS))} ({P.VARIANTS[0].name}: "
                         "normlab without attention and norm biases, what x-transformers has; never a peer)")
    ap.add_argument("--shape", choices=P.SHAPES, default="reference", help="the models' shape (peers.py)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per model per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --steps per comparison")
    ap.add_argument("--repeats", type=int, default=3, help="same-run comparisons; the table gives median [min, max]")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU; ~10x slower on CPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile normlab's model")
    ap.add_argument("--data", choices=("synthetic", "corpus"), default="synthetic")
    ap.add_argument("--small", action="store_true", help="--shape small: a small model, to check the script")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    ap.add_argument("--no-overhead", action="store_true", help="skip the Lightning overhead measurement")
    ap.add_argument("--json", help="also write the results here (every repeat's steps and ratios)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: {args.repeats}; must be at least 1")
    models = args.models.split(",")
    known = [c.name for c in (*P.PEERS, *P.VARIANTS)]
    if set(models) - set(known):
        ap.error(f"--models: {', '.join(sorted(set(models) - set(known)))}; allowed: {', '.join(known)}")
    variants = [c.name for c in P.VARIANTS if c.name in models]
    if variants and ("normlab" not in models or not {c.name for c in P.PEERS[1:]} & set(models)):
        ap.error(f"--models: {', '.join(variants)} is timed against normlab and a peer: add normlab and one of "
                 f"{', '.join(c.name for c in P.PEERS[1:])}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape_name = "small" if args.small else args.shape
    shape = P.shape(shape_name)
    batches = (P.synthetic_batches(shape, args.steps, device) if args.data == "synthetic"
               else P.corpus_batches(args.steps, shape.vocab, shape.batch * shape.length, device))
    settings = args.settings.split(",")
    for setting in settings:
        if setting not in P.SETTING_TEXT:
            ap.error(f"--settings: {setting!r}; allowed: {', '.join(P.SETTING_TEXT)}")
    peak = P.matmul_peak(device)
    runs, by_setting = build(settings, models, shape, device, args.compile)
    amp = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext

    def step(r, b):
        with amp():
            return P.timed_step(r["peer"], r["opt"], b, device)

    for r in runs:  # warm-up (and compilation), then one untimed step for peak memory
        t0 = time.perf_counter()
        for b in (batches * args.warmup)[: args.warmup]:
            step(r, b)
        r["warmup_s"] = time.perf_counter() - t0
        if not args.no_memory:
            with amp():
                r["peak_mib"] = P.peak_step_memory(r["peer"], r["opt"], batches[0], device) / 2 ** 20
    turn = 0
    for _ in range(args.repeats):  # each repeat one whole comparison
        for r in runs:
            r["tok_s"].append([])
        for _ in range(args.rounds):
            for b in batches:  # models take turns step by step, so load hits them alike
                for r in (runs if turn % 2 == 0 else runs[::-1]):  # and none always follows the same one
                    r["tok_s"][-1].append(b["ntokens"] / step(r, b))
                turn += 1

    flops = sum(P.step_flops(shape, b) for b in batches) / sum(b["ntokens"] for b in batches)  # per token
    print(f"torch {torch.__version__}, {device}, threads {torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}; {args.repeats} repeats x {args.rounds} rounds x "
          f"{args.steps} steps; shape {shape_name}: d{shape.d} {shape.layers}+{shape.layers} layers h{shape.heads} "
          f"ffn{shape.ffn} V{shape.vocab} {shape.placement}-norm, {args.data} batches "
          f"{tuple(batches[0]['src'].shape)}; bf16 {args.bf16}; compile {args.compile}")
    print(f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s (measured now); {flops / 1e6:.1f} MFLOP per target token")
    result = {"device": str(device), "threads": torch.get_num_threads(), "matmul_peak_gflops": peak / 1e9,
              "shape": shape_name, "repeats": args.repeats, "rounds": args.rounds, "steps": args.steps,
              "bf16": args.bf16, "compile": args.compile, "data": args.data, "settings": {},
              "repeat_results": [{s: compare(by_setting[s], i) for s in settings} for i in range(args.repeats)]}
    for setting in settings:
        rows = by_setting[setting]
        per_repeat = [rep[setting] for rep in result["repeat_results"]]
        print(f"\n{setting}: {P.SETTING_TEXT[setting]}")
        print(f"{'model':<22} {'params':>11} {'tok/s min':>10} {'median':>8} {'max':>8} {'MFU':>6} "
              f"{'peak MiB':>9} {'normlab/model [min, max]':>25}")
        out = result["settings"][setting] = {"models": {}}
        for r in rows:
            lo, med, hi = P.quantiles([x for rep in r["tok_s"] for x in rep])
            mfu = med * flops / peak
            paired = spread([c["normlab_over_model"][r["name"]] for c in per_repeat])
            print(f"{r['name']:<22} {r['params']:>11,} {P.fmt_int(lo):>10} {P.fmt_int(med):>8} "
                  f"{P.fmt_int(hi):>8} {mfu:>6.2f} {r.get('peak_mib', float('nan')):>9.0f} {fmt_spread(paired):>25}")
            out["models"][r["name"]] = {
                "params": r["params"], "tok_s_min": lo, "tok_s_median": med, "tok_s_max": hi, "mfu": mfu,
                "peak_mib": r.get("peak_mib"), "normlab_over_model": paired, "warmup_s": r["warmup_s"]}
        out["normlab_over_fastest"] = spread([c["normlab_over_fastest"] for c in per_repeat])
        out["fastest_peer"] = [c["fastest_peer"] for c in per_repeat]
        for v in P.VARIANTS:
            if f"{v.name}_over_fastest" in per_repeat[0]:
                out[f"{v.name}_over_fastest"] = spread([c[f"{v.name}_over_fastest"] for c in per_repeat])
    print(f"\nnormlab / fastest peer, median [min, max] over {args.repeats} same-run comparisons "
          "(each the median of adjacent-step ratios):")
    for setting in settings:
        out = result["settings"][setting]
        each = ", ".join(f"{v:.2f} ({name})" for v, name in zip(out["normlab_over_fastest"]["values"],
                                                                 out["fastest_peer"]))
        print(f"  {setting:<13} {fmt_spread(out['normlab_over_fastest']):<20} repeats: {each}")
        for v in P.VARIANTS:
            if f"{v.name}_over_fastest" in out:
                print(f"  {'':<13} {fmt_spread(out[f'{v.name}_over_fastest']):<20} {v.name} / the same peer")
    if args.compile:
        for r in runs:
            if r["name"] in ("normlab", *(c.name for c in P.VARIANTS)):
                print(f"torch.compile: {r['name']}: {r['warmup_s']:.1f} s for the {args.warmup} warm-up steps")
    for name, note in P.PEER_NOTES.items():
        print(f"note: {name}: {note}")
    if not args.no_overhead:
        from lightning_overhead import measure

        result["lightning_overhead"] = measure(small=shape_name == "small", device=args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
