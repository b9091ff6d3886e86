"""Training throughput of normlab against x-transformers and torch.nn.Transformer, in one run.

Three dropout settings (the papers' regularisation, dropout 0.1 everywhere, none) x three models
at the reference config (peers.py), the same batches for all, a full step each (forward,
label-smoothed loss, backward, Adam). The nine models take turns step by step for --rounds
rounds of --steps batches, so machine load hits them alike; the table gives target tokens/s per step
(min / median / max), MFU against the fp32 matmul peak measured at the start of the same run,
peak memory of one step, and normlab / model: the median over steps of the ratio of normlab's
step to the other model's adjacent step (robust to load that changes during the run). Then the Lightning loop's
overhead over a plain PyTorch loop on the same model and batches (lightning_overhead.py).

    python benchmarks/train_throughput.py                         # the record: CPU, all settings
    python benchmarks/train_throughput.py --device cuda --bf16    # GPU: bf16 autocast, fused Adam
    python benchmarks/train_throughput.py --small --steps 2 --rounds 1   # a quick check of the script
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
    runs = []
    for setting in settings:
        for cls in P.PEERS:
            if cls.name not in names:
                continue
            torch.manual_seed(0)
            try:
                peer = cls(shape, P.SETTINGS[setting], compile=compile and cls is P.Normlab)
            except ImportError as e:
                print(f"{cls.name}: skipped ({e}; pip install -e '.[bench]')")
                continue
            peer.model.to(device).train()
            runs.append({"setting": setting, "peer": peer, "opt": P.adam(peer.model.parameters(), device),
                         "tok_s": [], "params": sum(p.numel() for p in peer.model.parameters())})
    return runs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="papers,everywhere,none")
    ap.add_argument("--models", default=",".join(c.name for c in P.PEERS))
    ap.add_argument("--steps", type=int, default=8, help="timed steps per model per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU; ~10x slower on CPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile normlab's model")
    ap.add_argument("--data", choices=("synthetic", "corpus"), default="synthetic")
    ap.add_argument("--small", action="store_true", help="a small model, to check the script")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    ap.add_argument("--no-overhead", action="store_true", help="skip the Lightning overhead measurement")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = P.small(P.Shape()) if args.small else P.Shape()
    batches = (P.synthetic_batches(shape, args.steps, device) if args.data == "synthetic"
               else P.corpus_batches(args.steps, shape.vocab, 4096, device))
    settings = args.settings.split(",")
    peak = P.matmul_peak(device)
    runs = build(settings, args.models.split(","), shape, device, args.compile)
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
    for _ in range(args.rounds):  # models take turns step by step, so load hits them alike
        for b in batches:
            for r in runs:
                r["tok_s"].append(b["ntokens"] / step(r, b))

    flops = sum(P.step_flops(shape, b) for b in batches) / sum(b["ntokens"] for b in batches)  # per token
    print(f"torch {torch.__version__}, {device}, threads {torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}; {args.rounds} rounds x {args.steps} steps; "
          f"d{shape.d} {shape.layers}+{shape.layers} layers h{shape.heads} ffn{shape.ffn} V{shape.vocab}, "
          f"{args.data} batches {tuple(batches[0]['src'].shape)}; bf16 {args.bf16}; compile {args.compile}")
    print(f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s (measured now); {flops / 1e6:.1f} MFLOP per target token")
    result = {"device": str(device), "threads": torch.get_num_threads(), "matmul_peak_gflops": peak / 1e9,
              "rounds": args.rounds, "steps": args.steps, "bf16": args.bf16, "compile": args.compile,
              "data": args.data, "settings": {}}
    for setting in settings:
        rows = [r for r in runs if r["setting"] == setting]
        print(f"\n{setting}: {P.SETTING_TEXT[setting]}")
        print(f"{'model':<22} {'params':>11} {'tok/s min':>10} {'median':>8} {'max':>8} {'MFU':>6} "
              f"{'peak MiB':>9} {'normlab/model':>14}")
        ours = next((r["tok_s"] for r in rows if r["peer"].name == "normlab"), None)
        result["settings"][setting] = {}
        for r in rows:
            lo, med, hi = P.quantiles(r["tok_s"])
            mfu = med * flops / peak
            # normlab / model: median over steps of the ratio of the two models' adjacent steps
            paired = P.quantiles([a / b for a, b in zip(ours, r["tok_s"])])[1] if ours else float("nan")
            print(f"{r['peer'].name:<22} {r['params']:>11,} {P.fmt_int(lo):>10} {P.fmt_int(med):>8} "
                  f"{P.fmt_int(hi):>8} {mfu:>6.2f} {r.get('peak_mib', float('nan')):>9.0f} {paired:>14.2f}")
            result["settings"][setting][r["peer"].name] = {
                "params": r["params"], "tok_s_min": lo, "tok_s_median": med, "tok_s_max": hi, "mfu": mfu,
                "peak_mib": r.get("peak_mib"), "normlab_over_model": paired, "warmup_s": r["warmup_s"]}
    if args.compile:
        for r in runs:
            if r["peer"].name == "normlab":
                print(f"torch.compile: {r['warmup_s']:.1f} s for the {args.warmup} warm-up steps ({r['setting']})")
    for name, note in P.PEER_NOTES.items():
        print(f"note: {name}: {note}")
    if not args.no_overhead:
        from lightning_overhead import measure

        result["lightning_overhead"] = measure(small=args.small, device=args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
