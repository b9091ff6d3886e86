"""Parts c and e of the GPU check (gpu_check.py): plain training loops over peers.py's models, the
same weights and batches for every run, the runs taking turns step by step (train_throughput.py's
method), under bf16 autocast as trainer=gpu trains.

c. Fused Adam (what trainer=gpu runs) against foreach (torch's default on CUDA) and the for-loop, and
   torch.compile (model.compile=true's inductor) against eager, its compilation timed apart.
e. normlab against x-transformers and torch.nn.Transformer: train_throughput.py itself, at make
   train's shape and at the reference config; a peer that is not installed is reported missing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import peers as P
from gpu_parts import amp, device, failure, md_table, median, shapes, sync


# ---- c. fused Adam, torch.compile ----------------------------------------------------------------
@dataclass
class Run:
    name: str
    peer: object
    opt: torch.optim.Optimizer
    first_s: float = 0.0
    times: list[float] = field(default_factory=list)


def new_run(name: str, s: P.Shape, dev, adam: dict, compile_backend: str | None = None) -> Run:
    torch.manual_seed(0)  # every run starts from the same weights
    peer = P.Normlab(s, P.dropout("none"))
    peer.model.to(dev).train()
    if compile_backend:  # as model.compile=true compiles the training forward (lit_module.py)
        peer.forward = torch.compile(peer.model, backend=compile_backend)
    opt = torch.optim.Adam(peer.model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, **adam)
    return Run(name, peer, opt)


def in_turns(runs: list[Run], batches: list[dict], warmup: int, dev) -> None:
    """Each run's first step (compilation happens there) timed alone, `warmup` more untimed, then every
    batch stepped by every run in turns, the order reversed each batch (peers.py's timed_step: synced)."""
    def step(r, b):
        with amp(dev):
            return P.timed_step(r.peer, r.opt, b, dev)

    for r in runs:
        r.first_s = step(r, batches[0])
        for b in (batches * warmup)[:warmup]:
            step(r, b)
    for i, b in enumerate(batches):
        for r in (runs if i % 2 == 0 else runs[::-1]):
            r.times.append(step(r, b))


def over(r: Run, ref: Run) -> float:
    """r's step over ref's: the median over steps of adjacent steps' ratios (train_throughput.py)."""
    return median([a / b for a, b in zip(r.times, ref.times)])


def optimizer_ms(r: Run, dev, n: int) -> float:
    """optimizer.step() alone (on the last step's gradients), ms per call."""
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        r.opt.step()
    sync(dev)
    return (time.perf_counter() - t0) / n * 1e3


def adam_part(dry: bool, work: Path, out) -> None:
    dev = device(dry)
    s = shapes(dry)["default"]
    steps, warmup = (3, 1) if dry else (40, 5)
    batches = P.synthetic_batches(s, steps, dev)
    runs = [new_run("fused", s, dev, {"fused": True}), new_run("foreach", s, dev, {"foreach": True}),
            new_run("for-loop", s, dev, {"foreach": False})]
    out([f"make train's model ({_params(runs[0])} parameters in {len(list(runs[0].peer.model.parameters()))} "
         f"tensors), bf16 autocast, {steps} steps each in turns after {warmup + 1} untimed, the same weights "
         f"and batches ({tuple(batches[0]['src'].shape)} tokens a side); foreach is torch's default on "
         "CUDA, fused what trainer=gpu runs (lit_module.py). optimizer.step() alone: the last gradients again.", ""])
    in_turns(runs, batches, warmup, dev)
    tokens = batches[0]["ntokens"]
    out(md_table(["Adam", "step ms (median)", "tokens/s", "optimizer.step() ms", "step / fused's (median)"],
                 [[r.name, f"{median(r.times) * 1e3:.2f}", f"{tokens / median(r.times):,.0f}",
                   f"{optimizer_ms(r, dev, 3 if dry else 20):.3f}", f"{over(r, runs[0]):.3f}"] for r in runs]))


def _params(r: Run) -> str:
    return f"{sum(p.numel() for p in r.peer.model.parameters()):,}"


def compile_part(dry: bool, work: Path, out) -> None:
    dev = device(dry)
    s = shapes(dry)["default"]
    steps, warmup = (3, 1) if dry else (40, 3)
    # inductor is torch.compile's default and model.compile=true's; the dry run traces with dynamo
    # only ("eager"): inductor's CPU code generation would take minutes on a small CPU
    backend = "eager" if dry else "inductor"
    batches = P.synthetic_batches(s, steps, dev)
    out([f"make train's model, bf16 autocast, fused Adam, {steps} steps each in turns after {warmup + 1} untimed, "
         f"the same weights and batches; torch.compile(backend={backend!r}) as model.compile=true compiles the "
         "training forward. One batch shape: real batches vary in length, and torch.compile recompiles for a "
         "new shape until it marks it dynamic, which this does not time.", ""])
    runs = [new_run("eager", s, dev, {"fused": True}), new_run("compiled", s, dev, {"fused": True}, backend)]
    in_turns(runs, batches, warmup, dev)
    eager, compiled = runs
    out(md_table(["forward", "first step s", "step ms (median)", "tokens/s", "step / eager's (median)"],
                 [[r.name, f"{r.first_s:.2f}", f"{median(r.times) * 1e3:.2f}",
                   f"{batches[0]['ntokens'] / median(r.times):,.0f}", f"{over(r, eager):.3f}"] for r in runs]))
    out(["", f"Compilation: {compiled.first_s - eager.first_s:.1f} s (the compiled run's first step less the "
             "eager run's)."])


def speed_part(dry: bool, work: Path, out) -> None:
    for title, part in (("Fused Adam against foreach and for-loop Adam", adam_part),
                        ("torch.compile against eager", compile_part)):
        out(["", f"#### {title}", ""])
        try:
            part(dry, work, out)
        except Exception as e:  # noqa: BLE001  (reported; the next measurement still runs)
            out([failure(e)])
            out.failed = True


# ---- e. the peers ----------------------------------------------------------------------------------
def peers_part(dry: bool, work: Path, out) -> None:
    import importlib.util

    import train_throughput

    settings = "papers,none,none_model"
    if importlib.util.find_spec("x_transformers") is None:
        out(["**x-transformers: missing**, so not compared: it is not installed in this venv (it comes with "
             "`.venv/bin/pip install -e \".[bench]\"`, which needs the network: install it before the check)."])
    common = ["--settings", settings, "--no-overhead", "--bf16"]
    runs = ([("small", ["--small", "--device", "cpu", "--threads", "1", "--steps", "2", "--rounds", "1",
                        "--repeats", "1", "--warmup", "1"])] if dry else
            [(shape, ["--shape", shape, "--device", "cuda", "--steps", "8", "--rounds", "2", "--repeats", "3",
                      "--warmup", "3"]) for shape in ("tiny", "reference")])
    for shape, argv in runs:
        out(["", f"#### Shape {shape}: `train_throughput.py {' '.join(argv + common)}`", ""])
        try:
            res = train_throughput.main(argv + common)
        except Exception as e:  # noqa: BLE001  (reported; the next shape still runs)
            out([failure(e)])
            out.failed = True
            continue
        out([f"fp32 matmul peak {res['matmul_peak_gflops']:,.0f} GFLOP/s (measured at its start); median tokens/s "
             "and peak MiB of one step per model; normlab / fastest peer: median [min, max] over the same-run "
             "comparisons, each the median of adjacent-step ratios.", ""])
        out(peers_table(res, settings.split(",")))


def peers_table(res: dict, settings: list[str]) -> list[str]:
    names = [c.name for c in P.PEERS]
    rows = []
    for setting in settings:
        models = res["settings"][setting]["models"]
        cells = [f"{models[n]['tok_s_median']:,.0f} / {models[n]['peak_mib']:,.0f}" if n in models else "missing"
                 for n in names]
        ratio = res["settings"][setting]["normlab_over_fastest"]
        fastest = sorted(set(f for f in res["settings"][setting]["fastest_peer"] if f))
        rows.append([setting, *cells, f"{ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]",
                     ", ".join(fastest) or "-"])
    return md_table(["setting", *(f"{n} tok/s / MiB" for n in names), "normlab / fastest peer", "fastest peer"], rows)


PARTS = {"speed": speed_part, "peers": peers_part}
