"""Why `train.py trainer=gpu` ran 308 ms a step on an H100 where a plain loop ran 26 ms (2026-11-27):
cuDNN's SDPA plans every new input shape (model/attention.py, shape_free_sdpa). Needs CUDA.

    python benchmarks/gpu_sdpa_shapes.py        # ~2 min on an H100; writes $OUT/diag.txt (else /tmp)

1. make train's model in a plain loop (peers.py) over 60 token-bucketed corpus batches, twice (pass 1
   meets each shape for the first time, pass 2 again), with cuDNN attention allowed and then off.
2. `train.py trainer=gpu` (gpu_train.train, training only) for 150 steps under cProfile, and again with
   cuDNN off; then deep_bleu's 12+12 model. Run at commit 41c3ee9, before train.py turned cuDNN off
   itself: since then its two runs of make train's model both run without it.
The record: benchmarks/README.md, "GPU check"."""
import cProfile, io, os, pstats, statistics, sys, time
from pathlib import Path
ROOT = Path.cwd()
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]
import normlab  # noqa
import torch
import peers as P
from gpu_parts import shapes, amp
OUT = Path(os.environ.get("OUT", "/tmp"))
log = open(OUT / "diag.txt", "w")
def say(*a):
    print(*a, flush=True); print(*a, file=log, flush=True)
dev = torch.device("cuda")
s = shapes(False)["default"]
t0 = time.perf_counter()
batches = P.corpus_batches(60, 8000, 2048, dev)
say(f"corpus batches: {time.perf_counter()-t0:.1f} s; shapes src {sorted(set(tuple(b['src'].shape) for b in batches))[:8]} ... {len(set(tuple(b['src'].shape) for b in batches))} distinct")
def loop(label, cudnn):
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    torch.manual_seed(0)
    peer = P.Normlab(s, P.dropout("papers")); peer.model.to(dev).train()
    opt = torch.optim.Adam(peer.model.parameters(), lr=1e-4, fused=True)
    res = []
    for rep in range(2):
        ts = []
        for b in batches:
            with amp(dev):
                ts.append(P.timed_step(peer, opt, b, dev))
        res.append(ts)
    say(f"plain loop, corpus batches, {label}: pass 1 (new shapes) median {statistics.median(res[0])*1e3:.1f} ms, max {max(res[0])*1e3:.0f}, sum {sum(res[0]):.2f} s; pass 2 median {statistics.median(res[1])*1e3:.1f} ms, sum {sum(res[1]):.2f} s")
loop("cudnn SDPA allowed (default)", True)
loop("cudnn SDPA off", False)
torch.backends.cuda.enable_cudnn_sdp(True)
import gpu_train
work = Path("/tmp/diagwork"); work.mkdir(exist_ok=True)
def lit(tag, over, steps, cudnn, prof=False):
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    pr = cProfile.Profile() if prof else None
    if pr: pr.enable()
    t0 = time.perf_counter()
    try:
        r = gpu_train.train(tag, over, steps, 30, work, False)
    except Exception as e:
        say(f"lightning {tag}: FAILED {type(e).__name__}: {str(e)[:300]}"); return
    finally:
        if pr: pr.disable()
    say(f"lightning {tag} cudnn={cudnn}: {r['tokens_per_s']:,.0f} tok/s, {r['seconds']/max(r['timed_steps'],1)*1e3:.1f} ms/step, adam {r['adam']}, peak {r['peak_mib']:.0f} MiB, wall {time.perf_counter()-t0:.1f} s")
    if pr:
        st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(30); say(st.getvalue()[:9000])
lit("default-cudnn", [], 150, True, prof=True)
lit("default-nocudnn", [], 150, False)
lit("deep-nocudnn", gpu_train.deep_overrides(), 150, False)
