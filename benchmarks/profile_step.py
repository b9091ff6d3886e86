"""Where a training step's time goes: torch.profiler over a few steps of one model, grouped by
phase (forward, loss, backward, optimizer) and by component (matmuls, attention, dropout, masks,
norms, embeddings, elementwise, copies), with op counts, allocations and host syncs per step.

Backward ops are attributed to the forward op that created them (autograd sequence numbers), so
"dropout" includes its backward multiply and "masks" the ops that build attention masks. Times are
self times; under machine load read the fractions, not the milliseconds.

    python benchmarks/profile_step.py                        # normlab, all three dropout settings
    python benchmarks/profile_step.py --settings none --shape tiny    # make train's model
    python benchmarks/profile_step.py --settings none_model  # the model alone (full logits, F.cross_entropy)
    python benchmarks/profile_step.py --settings everywhere --model x-transformers
    python benchmarks/profile_step.py --small --steps 1      # a quick check
    python benchmarks/profile_step.py --trace trace.json     # also a Chrome trace of the last setting
    python benchmarks/profile_step.py --calls --settings none_model --shape tiny  # + Python calls per step

--calls also counts, per step, the Python function calls of each phase (cProfile: a count, which
load does not distort, unlike the per-op overhead it stands for), the autograd graph's nodes, the
minor page faults of each phase and the functions called most often.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import re
import resource
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import normlab  # noqa: F401,E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import peers as P  # noqa: E402

PHASES = ("forward", "loss", "backward", "optimizer")
LABELS = ("dropout", "masks")  # record_function labels put around these in forward (see _label)
COMPONENTS = [  # (component, regex on a forward op name or a backward node name), first match wins
    ("attention", r"scaled_dot_product|flash_attention|efficient_attention|ScaledDotProduct|softmax|Softmax"),
    ("matmul", r"addmm|\bmm\b|bmm|linear|matmul|Addmm|MmBackward|BmmBackward|Linear"),
    ("norm", r"layer_norm|LayerNorm|rsqrt|vector_norm|Norm"),
    ("embedding", r"embedding|Embedding"),
    ("optimizer", r"adam|Adam|_foreach|lerp|addcdiv|addcmul_"),
    ("copies", r"copy_|clone|contiguous|\bto\b|_to_copy|empty|zeros|ones|cat|index|ToCopy|Clone|Cat"),
]
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero")


def _label(fn, name):
    def wrapped(*a, **k):
        with record_function(name):
            return fn(*a, **k)
    return wrapped


@contextlib.contextmanager
def instrument():
    # Label dropout and mask building in normlab's forward (profile only; the model is unchanged),
    # undone on exit: the labels' own Python calls must not count in --calls.
    import torch.nn.functional as F
    import normlab.model.attention as A

    targets = [(torch.nn.Dropout, "forward", "dropout"), (A, "_attention_mask", "masks"), (F, "dropout", "dropout")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
    for obj, attr, name in targets:
        setattr(obj, attr, _label(getattr(obj, attr), name))
    try:
        yield
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)


def _component(name: str) -> str:
    for comp, rx in COMPONENTS:
        if re.search(rx, name):
            return comp
    return "elementwise/other"


def _enclosing(e, names):
    p = e
    while p is not None:
        if p.name in names:
            return p.name
        p = p.cpu_parent
    return None


def summarize(events, steps: int) -> dict:
    label_of_seq: dict[tuple[int, str], str] = {}
    for e in events:  # forward ops inside a label range or the loss: their autograd (sequence number, op)
        lab = _enclosing(e, LABELS) or _enclosing(e, ("loss",))  # the loss's backward (log-softmax's) is "loss"
        if lab and e.sequence_nr >= 0:
            label_of_seq.setdefault((e.sequence_nr, _norm(e.name)), lab)
    table = defaultdict(float)  # (phase, component) -> ms
    ops, outer, top, kernels, syncs, alloc = Counter(), Counter(), Counter(), Counter(), 0, 0
    for e in events:
        if e.name in PHASES or e.name in LABELS or e.name.startswith("ProfilerStep"):
            continue
        phase = _enclosing(e, PHASES) or "other"
        comp = _enclosing(e, LABELS)
        if comp is None and phase == "backward":
            node = _enclosing_node(e)
            comp = label_of_seq.get((node.sequence_nr, _norm(node.name))) if node is not None else None
            comp = comp or (_component(node.name) if node is not None else _component(e.name))
        comp = comp or _component(e.name)
        if phase == "loss" and comp != "matmul":  # normlab's loss also runs the output projection
            comp = "loss"
        if phase == "optimizer":
            comp = "optimizer"
        table[phase, comp] += e.self_cpu_time_total / 1e3
        top[f"{phase}/{comp}: {e.name}"] += e.self_cpu_time_total / 1e3 / steps
        if e.name.startswith("aten::"):
            ops[phase] += 1
            # called from Python (or the autograd engine), not inside another op: each pays the
            # binding's argument parsing and result wrapping on top of the dispatch
            outer[phase] += not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
        if phase == "forward" and re.search(r"aten::_(scaled_dot_product|flash|efficient)", e.name):
            kernels[e.name] += 1  # which SDPA kernel each mask led to (GPU: flash / efficient / math)
        syncs += e.name in SYNC_OPS
        alloc += max(e.self_cpu_memory_usage, 0)
    return {"table": {k: v / steps for k, v in table.items()}, "ops": {k: v / steps for k, v in ops.items()},
            "outer": {k: v / steps for k, v in outer.items()},
            "syncs": syncs / steps, "alloc_mib": alloc / steps / 2 ** 20, "top": top.most_common(12),
            "sdpa": {k: v / steps for k, v in kernels.items()}}


def _norm(name: str) -> str:
    # "aten::native_dropout" and "autograd::engine::evaluate_function: NativeDropoutBackward0" -> the
    # same key: ops that create no autograd node share the next node's sequence number, the name
    # tells which op made it.
    name = re.sub(r"Backward\d*$", "", name.split(":")[-1].strip())
    return name.replace("_", "").lower()


def _enclosing_node(e):
    p = e
    while p is not None:
        if p.name.startswith("autograd::engine::evaluate_function"):
            return p
        p = p.cpu_parent
    return None


def _warm(cls, shape, setting, batches, device):
    # The model and optimizer after two steps (lazy state: Adam's moments, the allocator's pools).
    torch.manual_seed(0)
    peer = P.build(cls, shape, setting)
    peer.model.to(device).train()
    opt = P.adam(peer.model.parameters(), device)
    for b in batches[:2]:
        P.timed_step(peer, opt, b, device)
    return peer, opt


def profile_setting(cls, shape, setting, batches, device, steps, trace=None):
    peer, opt = _warm(cls, shape, setting, batches, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, profile_memory=True, with_stack=False) as prof:
        for b in batches[:steps]:
            opt.zero_grad(set_to_none=True)
            for phase, run in _phases(peer, opt, b, {}):
                with record_function(phase):
                    run()
    if trace:
        prof.export_chrome_trace(trace)
    return summarize(prof.events(), steps)


def _phases(peer, opt, b, out: dict):
    # One training step as (phase, thunk) pairs, run in order (out: the logits and loss between
    # them): what both profilers see.
    return (("forward", lambda: out.__setitem__("logits", _forward(peer, b))),
            ("loss", lambda: out.__setitem__("loss", _loss(peer, out["logits"], b))),
            ("backward", lambda: out["loss"].backward()),
            ("optimizer", opt.step))


def autograd_nodes(loss: torch.Tensor) -> int:
    # The nodes of the graph behind `loss` (AccumulateGrad included): each is work for the engine.
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(f for f, _ in node.next_functions)
    return len(seen)


def count_calls(cls, shape, setting, batches, device, steps, top: int = 15) -> dict:
    """Python function calls per step by phase (cProfile), autograd nodes per step and the most
    called functions, over the same steps as profile_setting."""
    peer, opt = _warm(cls, shape, setting, batches, device)
    profs = {p: cProfile.Profile() for p in PHASES}
    nodes, faults = 0, Counter()
    for b in batches[:steps]:
        opt.zero_grad(set_to_none=True)
        out = {}
        for phase, run in _phases(peer, opt, b, out):
            if phase == "backward":
                nodes += autograd_nodes(out["loss"])
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            profs[phase].runcall(run)
            faults[phase] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    stats = {p: pstats.Stats(pr).stats for p, pr in profs.items()}
    calls = {p: sum(v[1] for v in st.values()) / steps for p, st in stats.items()}
    total = Counter()
    for st in stats.values():
        for (path, line, fn), v in st.items():
            total[f"{re.sub(r'.*(site-packages|src)/', '', path)}:{line}({fn})"] += v[1] / steps
    return {"calls": calls, "nodes": nodes / steps, "top": total.most_common(top),
            "faults": {k: v / steps for k, v in faults.items()}}


def print_calls(c: dict) -> None:
    print(f"Python calls per step: {dict((k, round(v)) for k, v in c['calls'].items())} "
          f"(total {sum(c['calls'].values()):.0f}); autograd nodes per step: {c['nodes']:.0f}")
    # fresh pages the allocator got from the OS (glibc maps large blocks afresh and trims its heap):
    # each is zeroed by the kernel on first touch. Varies between processes: compare several runs.
    print(f"minor page faults per step: {dict((k, round(v)) for k, v in c['faults'].items())}")
    print("most called (per step): " + "; ".join(f"{n} {v:.0f}" for n, v in c["top"]))


def _chunked(peer) -> bool:
    # normlab as it trains: the loss applies the output projection (losses.model_loss)
    return peer.name == "normlab" and not peer.full_logits


def _forward(peer, b):
    if _chunked(peer):
        return peer.model.output_projection.operands(peer.model(b["src"], b["tgt_in"], project=False))
    return peer.logits(b["src"], b["tgt_in"])  # (B, T, V)


def _loss(peer, logits, b):
    if _chunked(peer):
        from normlab.losses import projected_label_smoothed_nll

        return projected_label_smoothed_nll(*logits, b["tgt_out"], 0.1, 0)[0] / b["ntokens"]
    return P.label_smoothed_ce(logits, b["tgt_out"], b["ntokens"])


def print_summary(setting: str, s: dict) -> None:
    t = s["table"]
    total = sum(t.values())
    print(f"\n{setting}: {P.SETTING_TEXT[setting]}  ({total:.0f} ms of op self time per step)")
    phases = [p for p in (*PHASES, "other") if any(k[0] == p for k in t)]
    comps = sorted({k[1] for k in t}, key=lambda c: -sum(v for k, v in t.items() if k[1] == c))
    print(f"{'component':<18}" + "".join(f"{p:>11}" for p in phases) + f"{'total':>9}{'share':>7}")
    for c in comps:
        row = [t.get((p, c), 0.0) for p in phases]
        print(f"{c:<18}" + "".join(f"{v:>11.1f}" for v in row) + f"{sum(row):>9.1f}{100 * sum(row) / total:>6.1f}%")
    shares = [sum(v for k, v in t.items() if k[0] == p) for p in phases]
    print(f"{'phase total':<18}" + "".join(f"{v:>11.1f}" for v in shares) + f"{total:>9.1f}")
    print(f"{'phase share':<18}" + "".join(f"{100 * v / total:>10.1f}%" for v in shares))
    print(f"aten ops per step: {dict((k, round(v)) for k, v in s['ops'].items())}, of them not inside another op: "
          f"{dict((k, round(v)) for k, v in s['outer'].items())}; host syncs per step "
          f"(item/nonzero): {s['syncs']:.1f}; allocated per step: {s['alloc_mib']:.0f} MiB")
    print(f"attention kernels per step: {s['sdpa']}")
    print("top ops (self ms per step): " + "; ".join(f"{n} {v:.1f}" for n, v in s["top"]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="none,papers,everywhere", help=f"of {', '.join(P.SETTING_TEXT)}")
    ap.add_argument("--shape", choices=P.SHAPES, default="reference", help="the model's shape (peers.py)")
    ap.add_argument("--model", default="normlab", choices=[c.name for c in P.PEERS])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--small", action="store_true", help="--shape small")
    ap.add_argument("--trace", help="write a Chrome trace of the last setting here")
    ap.add_argument("--calls", action="store_true", help="also Python calls (cProfile) and autograd nodes per step")
    args = ap.parse_args(argv)
    settings = args.settings.split(",")
    for setting in settings:
        if setting not in P.SETTING_TEXT:
            ap.error(f"--settings: {setting!r}; allowed: {', '.join(P.SETTING_TEXT)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = P.shape("small" if args.small else args.shape)
    batches = P.synthetic_batches(shape, max(args.steps, 2), device)
    cls = next(c for c in P.PEERS if c.name == args.model)
    print(f"{args.model}, torch {torch.__version__}, {device}, threads {torch.get_num_threads()}, "
          f"d{shape.d} {shape.layers}+{shape.layers} layers {shape.placement}-norm, "
          f"batch {tuple(batches[0]['src'].shape)}, {args.steps} profiled steps")
    for i, setting in enumerate(settings):
        with instrument():
            s = profile_setting(cls, shape, setting, batches, device, args.steps,
                                trace=args.trace if i == len(settings) - 1 else None)
        print_summary(setting, s)
        if args.calls:
            print_calls(count_calls(cls, shape, setting, batches, device, args.steps))


if __name__ == "__main__":
    main()
