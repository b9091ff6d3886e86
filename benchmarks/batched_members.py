"""Several small models in one process (issue 36 item 2), measured before it is built: K members of one
architecture on the same batches, one training step each (forward, the chunked label-smoothed loss,
backward, Adam with each member's own learning rate), three ways, taking turns step by step:

  (a) seq:  K separate models stepped one after the other (today: K x one run's step; foreach Adam)
  (b) vmap: the members stacked, the model's own code under torch.vmap(functional_call), one backward
  (c) bmm:  the members stacked, a hand-batched forward (baddbmm per linear layer, attention one SDPA
            call over the members' K·B rows), one backward
(batched.py; (b) and (c) share the stacked Adam.) The table gives, per shape, thread count and K, one
member's step (seq's time / K, median over turns) and each batched way's step relative to it, the
median over turns of that turn's ratio: the issue's target is K = 4 at <= 1.6x one run's step (one run
on both cores: 2 threads). All ways train the same members from the same initial weights, so their
losses at the last step must agree (printed: the largest relative difference, members x ways).

    python benchmarks/batched_members.py                           # both shapes, K 1,2,4, 1 and 2 threads
    python benchmarks/batched_members.py --shapes deep_bleu --threads 2 --members 4   # the issue's target
    python benchmarks/batched_members.py --profile seq:1,bmm:4     # + torch.profiler: phases, top ops
    python benchmarks/batched_members.py --kernels 15              # + the forward kernels, per member vs batched
    python benchmarks/batched_members.py --small --steps 2 --warmup 1   # check the script (seconds)
Nothing else should run on the machine meanwhile (see benchmarks/README.md); the load average is printed.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import normlab  # noqa: F401,E402  (sets OMP_WAIT_POLICY before torch loads)
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.profiler import record_function  # noqa: E402

import batched as Bm  # noqa: E402
import peers as P  # noqa: E402
from normlab.config import ModelConfig, NormConfig  # noqa: E402
from normlab.losses import projected_label_smoothed_nll  # noqa: E402
from normlab.model.transformer import Seq2SeqTransformer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# A screen's grid (conf/study: e.g. lr x warmup); member k takes setting k mod 8. Time does not depend on it.
SETTINGS = [(lr, w) for w in (150, 1000) for lr in (3e-3, 2e-3, 1e-3, 5e-4)]
METHODS = ("seq", "vmap", "bmm")
# The parameters' grad views have the stacked parameter's strides, not a dense layout's: torch says so once.
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")


def model_config(shape: str, placement: str) -> ModelConfig:
    """make train's model (conf/model/tiny.yaml), or deep_bleu's: tiny.yaml with conf/study/deep_bleu.yaml's
    `common` model.* overrides (read, so they cannot drift apart); the bundled corpus' 8k vocabulary."""
    m = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/tiny.yaml"))
    if shape == "deep_bleu":
        for o in OmegaConf.load(ROOT / "conf/study/deep_bleu.yaml").common:
            key, _, value = o.partition("=")
            if key.startswith("model."):
                m[key[len("model."):]] = type(m[key[len("model."):]])(value)
    if shape == "small":  # a toy, to check the script
        m.update(d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn=64, decoder_ffn=64)
    keys = ("d_model", "encoder_layers", "decoder_layers", "encoder_heads", "decoder_heads", "encoder_ffn",
            "decoder_ffn", "dropout", "attention_dropout", "activation_dropout")
    return ModelConfig(vocab_size=8000, norm=NormConfig(placement=placement), **{k: m[k] for k in keys})


def members(cfg: ModelConfig, K: int, init: str) -> list[Seq2SeqTransformer]:
    # same: one seed for every member (a screen: the arm's seed, settings differ); seeds: seed 1..K
    out = []
    for k in range(K):
        torch.manual_seed(1 if init == "same" else k + 1)
        out.append(Seq2SeqTransformer(cfg).train())
    return out


class Seq:
    """(a): K models, each with its own foreach Adam (lit_module's CPU optimizer), one after the other."""

    def __init__(self, models):
        self.models = [copy.deepcopy(m) for m in models]
        self.opts = [P.adam(m.parameters(), "cpu") for m in self.models]
        self.steps = 0

    def step(self, b: dict) -> list[float]:
        self.steps += 1
        losses = []
        for k, (m, opt) in enumerate(zip(self.models, self.opts)):
            for g in opt.param_groups:
                g["lr"] = Bm.member_lr(*SETTINGS[k % len(SETTINGS)], self.steps)
            opt.zero_grad(set_to_none=True)
            with record_function("forward"):  # model_loss, in the phases batched.batched_step names
                states = m(b["src"], b["tgt_in"], project=False)
            with record_function("loss"):
                x, w = m.output_projection.operands(states)
                loss = projected_label_smoothed_nll(x, w, b["tgt_out"], 0.1, 0)[0] / b["ntokens"]
            with record_function("backward"):
                loss.backward()
            with record_function("adam"):
                opt.step()
            losses.append(loss.item())
        return losses


class Batched:
    def __init__(self, models, forward):
        self.st, self.forward = Bm.Stacked(copy.deepcopy(models)), forward

    def step(self, b: dict) -> list[float]:
        lrs = [Bm.member_lr(*SETTINGS[k % len(SETTINGS)], self.st.steps + 1) for k in range(self.st.K)]
        return [x.item() for x in Bm.batched_step(self.st, self.forward, b, lrs)]


def build(method: str, models):
    return Seq(models) if method == "seq" else Batched(models, Bm.FORWARDS[method])


def measure(cfg, K: int, args, batches) -> dict:
    models = members(cfg, K, args.init)
    runs = {m: build(m, models) for m in args.methods}
    for j in range(args.warmup):  # untimed; every way trains the same steps
        for r in runs.values():
            r.step(batches[j % len(batches)])
    times = {m: [] for m in runs}
    losses = {}
    for i in range(args.steps):
        b = batches[i % len(batches)]
        for m in (list(runs) if i % 2 == 0 else list(runs)[::-1]):  # none always follows the same one
            t0 = time.perf_counter()
            losses[m] = runs[m].step(b)
            times[m].append(time.perf_counter() - t0)
    one = [t / K for t in times["seq"]]  # one member's single-model step, turn by turn
    out = {"K": K, "one_member_s": P.quantiles(one)[1], "times": times}
    for m in runs:
        out[f"{m}_over_one"] = P.quantiles([t / o for t, o in zip(times[m], one)])[1]
    ref = losses["seq"]
    out["loss_rel_diff"] = max((abs(a - r) / abs(r) for m in runs for a, r in zip(losses[m], ref)), default=0.0)
    return out


PHASES = ("forward", "loss", "backward", "adam")
GROUPS = {"attention kernels (SDPA, fwd + bwd)": ("aten::_scaled_dot_product",),
          "matmuls (mm, bmm, addmm, baddbmm)": ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")}


def profile(cfg, spec: str, args, batches) -> dict:
    """torch.profiler over two steps of one way at K members (after two untimed ones): each phase's time
    (forward to the decoder's states, the chunked loss with its gradient, the model's backward, Adam),
    the attention kernels' and the matmuls' self time, the top ops by self CPU time, and the SDPA calls
    a step makes (under vmap, CPU's SDPA has no batching rule: it runs once per member)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    method, K = spec.split(":")
    run = build(method, members(cfg, int(K), args.init))
    for b in batches[:2]:
        run.step(b)
    t0 = time.perf_counter()
    with prof(activities=[ProfilerActivity.CPU]) as p:
        for b in batches[:2]:
            run.step(b)
    wall = (time.perf_counter() - t0) / 2
    ev = p.key_averages()
    total = sum(e.self_cpu_time_total for e in ev if e.key not in PHASES)
    out = {"way": method, "K": int(K), "threads": torch.get_num_threads(), "wall_s_per_step": wall,
           "phases_s": {e.key: e.cpu_time_total / 2e6 for e in ev if e.key in PHASES},
           "groups_s": {g: sum(e.self_cpu_time_total for e in ev if e.key.startswith(pre)) / 2e6
                        for g, pre in GROUPS.items()},
           "sdpa_calls": sum(e.count for e in ev if e.key.startswith("aten::_scaled_dot_product")
                             and not e.key.endswith("backward")) / 2,
           "ops": sum(e.count for e in ev if e.key not in PHASES) / 2}
    print(f"\nprofile: {method}, K={K}, {out['threads']} thread(s), 2 steps: {wall:.2f} s a step under the "
          f"profiler; {out['ops']:,.0f} ops a step, {out['sdpa_calls']:.0f} SDPA forward calls")
    step = sum(out["phases_s"].values()) or 1.0
    print("  phases: " + ", ".join(f"{k} {v:.3f} s ({v / step:.0%})" for k, v in out["phases_s"].items()))
    print("  " + ", ".join(f"{k} {v:.3f} s ({v * 2e6 / total:.0%} of self time)" for k, v in out["groups_s"].items()))
    print(f"  {'op':<58} {'calls/step':>10} {'self s/step':>11} {'share':>6}")
    top = sorted((e for e in ev if e.key not in PHASES), key=lambda e: -e.self_cpu_time_total)[: args.top]
    for e in top:
        print(f"  {e.key[:58]:<58} {e.count / 2:>10.0f} {e.self_cpu_time_total / 2e6:>11.3f} "
              f"{e.self_cpu_time_total / total:>6.1%}")
    out["top"] = [(e.key, e.count / 2, e.self_cpu_time_total / 2e6) for e in top]
    return out


def kernels(cfg, K: int, b: dict, reps: int) -> list[dict]:
    """The forward kernels of one member's step at the model's shapes (the batch's target rows, N = B·T),
    in turns, `reps` times: each linear layer as K F.linear calls (one per member, today), as one baddbmm
    over the members (the hand-batched way) and as one F.linear on K·N rows with one weight (what a
    larger batch of one model would cost: the best batching over the members could do), and decoder
    self-attention as K SDPA calls against one over K·B rows. Medians; GFLOP/s of the K members' work."""
    B, T = b["tgt_in"].shape
    N, d, f, H = B * T, cfg.d_model, cfg.decoder_ffn, cfg.decoder_heads
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    linear, sdpa = torch.nn.functional.linear, torch.nn.functional.scaled_dot_product_attention
    cases = {}
    for name, (i, o) in {"q,k,v fused": (d, 3 * d), "out_proj": (d, d), "fc1": (d, f), "fc2": (f, d)}.items():
        x, w, bias = rnd(K, N, i), rnd(K, o, i), rnd(K, o)
        cases[f"linear {name} ({N}x{i} @ {i}x{o})"] = (2.0 * K * N * i * o, {
            "per member": lambda x=x, w=w, bias=bias: [linear(x[j], w[j], bias[j]) for j in range(K)],
            "baddbmm": lambda x=x, w=w, bias=bias: torch.baddbmm(bias[:, None], x, w.transpose(1, 2)),
            "K·N rows": lambda x=x, w=w, bias=bias: linear(x.flatten(0, 1), w[0], bias[0])})
    q, k, v = (rnd(K, B, H, T, d // H) for _ in range(3))
    cases[f"SDPA causal ({B}x{H}x{T}x{d // H})"] = (2.0 * 2 * K * B * H * T * T * (d // H), {
        "per member": lambda: [sdpa(q[j], k[j], v[j], is_causal=True) for j in range(K)],
        "baddbmm": lambda: sdpa(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), is_causal=True),
        "K·N rows": lambda: sdpa(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), is_causal=True)})
    rows = []
    for label, (flops, ways) in cases.items():
        times = {w: [] for w in ways}
        for w in ways.values():  # untimed: the first call allocates
            w()
        for r in range(reps):
            for w in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                t0 = time.perf_counter()
                ways[w]()
                times[w].append(time.perf_counter() - t0)
        med = {w: P.quantiles(t)[1] for w, t in times.items()}
        rows.append({"kernel": label, "K": K, "threads": torch.get_num_threads(),
                     **{f"{w} s": t for w, t in med.items()},
                     **{f"{w} GFLOP/s": flops / t / 1e9 for w, t in med.items()}})
    print(f"\nkernels, K={K}, {torch.get_num_threads()} thread(s) (forward; GFLOP/s of the K members' work; "
          "for SDPA both batched columns are one call over K·B rows)")
    print("| kernel | per member (K calls) | baddbmm over members | one weight, K·N rows |")
    print("|---|---:|---:|---:|")
    for r in rows:
        ways = ("per member", "baddbmm", "K·N rows")
        print(f"| {r['kernel']} | " + " | ".join(f"{r[f'{w} GFLOP/s']:.1f}" for w in ways) + " |")
    return rows


def table(rows: list[dict], methods: list[str]) -> None:
    batched = [m for m in methods if m != "seq"]
    print("\n| shape | threads | K | one member s/step | " + " | ".join(f"{m} / one member" for m in methods)
          + (" | members per one-member step (best batched way) |" if batched else " |"))
    print("|---|---:|---:|---:|" + "---:|" * len(methods) + ("---:|" if batched else ""))
    for r in rows:
        best = f" {r['K'] / min(r[f'{m}_over_one'] for m in batched):.2f} |" if batched else ""
        print(f"| {r['shape']} | {r['threads']} | {r['K']} | {r['one_member_s']:.3f} | "
              + " | ".join(f"{r[f'{m}_over_one']:.2f}" for m in methods) + " |" + best)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="deep_bleu,tiny", help="deep_bleu (12+12, d 64) and/or tiny (3+3, d 128)")
    ap.add_argument("--members", default="1,2,4", help="the K to measure")
    ap.add_argument("--threads", default="1,2", help="torch threads, each measured in turn")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)} (seq is always run)")
    ap.add_argument("--steps", type=int, default=8, help="timed turns per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each way first")
    ap.add_argument("--placement", choices=("pre", "post"), default="pre",
                    help="norm placement (deep_bleu's pre_ln arm: pre)")
    ap.add_argument("--init", choices=("same", "seeds"), default="same",
                    help="same: every member from seed 1 (a screen); seeds: member k from seed k+1")
    ap.add_argument("--data", choices=("corpus", "synthetic"), default="corpus",
                    help="corpus: the bundled corpus' 2,048-token training batches; synthetic: 64 x 32 tokens")
    ap.add_argument("--profile", metavar="WAY:K[,WAY:K]", help="also profile these ways at K members (at the first "
                    "shape and thread count), e.g. seq:1,bmm:4")
    ap.add_argument("--kernels", type=int, default=0, metavar="REPS",
                    help="also time the forward kernels at the first shape, largest K, each thread count (REPS turns)")
    ap.add_argument("--top", type=int, default=15, help="ops in the profile's table")
    ap.add_argument("--small", action="store_true", help="a toy shape, to check the script")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    shapes = ["small"] if args.small else args.shapes.split(",")
    if set(shapes) - {"deep_bleu", "tiny", "small"}:
        ap.error(f"--shapes: {args.shapes}; allowed: deep_bleu, tiny")
    args.methods = ["seq", *[m for m in args.methods.split(",") if m != "seq"]]
    if set(args.methods) - set(METHODS):
        ap.error(f"--methods: {','.join(args.methods)}; allowed: {', '.join(METHODS)}")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    Ks = [int(k) for k in args.members.split(",") if k]
    threads = [int(t) for t in args.threads.split(",")]
    specs = args.profile.split(",") if args.profile else []
    if any(x.partition(":")[0] not in METHODS or not x.partition(":")[2].isdigit() for x in specs):
        ap.error(f"--profile: {args.profile!r}; expected WAY:K[,WAY:K], e.g. seq:1,bmm:4")
    if not Ks and not specs:
        ap.error("nothing to do: --members is empty and no --profile")
    n = max(args.steps, 2)
    batches = (P.corpus_batches(n, 8000, 2048, "cpu") if args.data == "corpus" else
               P.synthetic_batches(P.Shape(vocab=8000, batch=64, length=32), n, "cpu"))
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f}; {args.data} batches, {args.steps} turns after {args.warmup} "
          f"warm-up steps; members from {'one seed' if args.init == 'same' else 'seeds 1..K'}, {args.placement}-norm")
    rows = []
    t_start = time.time()
    for shape in shapes:
        cfg = model_config(shape, args.placement)
        for t in threads:
            torch.set_num_threads(t)
            for K in Ks:
                r = measure(cfg, K, args, batches)
                r.update(shape=shape, threads=t)
                rows.append(r)
                ways = "  ".join(f"{m} {r[f'{m}_over_one']:.2f}x" for m in args.methods)
                print(f"{shape} {t} thread(s) K={K}: one member {r['one_member_s']:.3f} s/step; {ways}; "
                      f"losses agree to {r['loss_rel_diff']:.1e}", flush=True)
    if rows:
        print(f"\nload average at the end {os.getloadavg()[0]:.1f}; {time.time() - t_start:.0f} s")
        table(rows, args.methods)
    kernel_rows = []
    for t in threads if args.kernels else []:
        torch.set_num_threads(t)
        kernel_rows += kernels(model_config(shapes[0], args.placement), max(Ks or [4]), batches[0], args.kernels)
    torch.set_num_threads(threads[0])
    profiles = [profile(model_config(shapes[0], args.placement), x, args, batches) for x in specs]
    out = {"torch": torch.__version__, "cores": os.cpu_count(), "steps": args.steps, "warmup": args.warmup,
           "data": args.data, "init": args.init, "placement": args.placement, "rows": rows,
           "kernels": kernel_rows, "profiles": profiles}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
