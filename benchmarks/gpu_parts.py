"""The parts of the GPU check (gpu_check.py runs each in its own process): a (device) here, b and d
(train, precision) in gpu_train.py, c and e (speed, peers) in gpu_speed.py; the helpers they share.

    python benchmarks/gpu_parts.py <part> --result part.md [--work DIR] [--dry-run]

A part appends its section (Markdown lines) to --result as it measures, so a part stopped at its cap
still reports what it had. The models are peers.py's: make train's model (`tiny`: conf/model/tiny.yaml,
pre-norm, batches of 64 x 32 tokens) and deep_bleu's 12+12, d 64, FFN 256 model; on the GPU every
step runs under bf16 autocast with fused Adam, as trainer=gpu trains (--dry-run: CPU, tiny sizes).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import subprocess
import sys
import traceback
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import normlab  # noqa: F401,E402  (sets OMP_WAIT_POLICY before torch loads)
import torch  # noqa: E402

import peers as P  # noqa: E402

# The aten op each SDPA kernel runs as (the profiler's CPU-side names; forward ops, one per call).
KERNEL_OPS = {"aten::_scaled_dot_product_flash_attention": "flash",
              "aten::_scaled_dot_product_efficient_attention": "efficient",
              "aten::_scaled_dot_product_cudnn_attention": "cudnn",
              "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
              "aten::_scaled_dot_product_attention_math": "math",
              "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable"}
BACKENDS = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn",
            "MATH": "math"}


def device(dry: bool) -> torch.device:
    return torch.device("cpu" if dry else "cuda")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def amp(dev: torch.device):
    # trainer=gpu's precision, bf16-mixed: Lightning's is this autocast (bf16 on CPU in the dry run too)
    return torch.autocast(dev.type, dtype=torch.bfloat16)


def shapes(dry: bool) -> dict[str, P.Shape]:
    """make train's model and deep_bleu's (its `common`: 12+12, d 64, FFN 256; 4 heads and pre-norm as
    the defaults); --dry-run: 3+3 and 2+2 layers of d 32, FFN 64, a 300-word vocabulary, on 4 x 8 tokens."""
    tiny = P.tiny_shape()
    deep = replace(tiny, d=64, layers=12, ffn=256)
    if dry:
        tiny, deep = (replace(s, d=32, ffn=64, vocab=300, batch=4, length=8, layers=n) for s, n in ((tiny, 3), (deep, 2)))
    return {"default": tiny, "12+12 d 64": deep}


def md_table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table; rows can follow later, one `md_row` each (a part stopped at its cap keeps
    the rows it had)."""
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|", *map(md_row, rows)]


def md_row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def failure(e: BaseException) -> str:
    """An exception in one line, for a report row or line (its traceback goes to the log)."""
    traceback.print_exc()
    text = " ".join(str(e).split())
    return f"FAILED: {type(e).__name__}: {text[:150] + '...' if len(text) > 150 else text}"


def median(xs: list[float]) -> float:
    return P.quantiles(xs)[1]


# ---- a. the device -------------------------------------------------------------------------------
def device_part(dry: bool, work: Path, out) -> None:
    dev = device(dry)
    if dev.type == "cuda":
        from normlab.model.attention import shape_free_sdpa

        shape_free_sdpa(dev)  # as train.py and the decoding commands run (no cuDNN attention): what they use
        p = torch.cuda.get_device_properties(0)
        b = torch.backends.cuda
        out([f"- GPU: {p.name}, {p.total_memory / 2 ** 30:.1f} GiB, compute capability {p.major}.{p.minor}, "
             f"{p.multi_processor_count} SMs, driver {_driver()}; bf16 "
             f"{'supported' if torch.cuda.is_bf16_supported() else 'NOT supported'}",
             f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; "
             f"host: {platform.machine()}, {_cores()} cores",
             f"- SDPA backends enabled (torch.backends.cuda): flash {_yes(b.flash_sdp_enabled())}, memory-efficient "
             f"{_yes(b.mem_efficient_sdp_enabled())}, cuDNN {_yes(b.cudnn_sdp_enabled())}, math "
             f"{_yes(b.math_sdp_enabled())}; fp32 matmul precision {torch.get_float32_matmul_precision()!r}"])
    else:
        from normlab.hardware import cpu_text

        out([f"- CPU (dry run, no GPU): {platform.machine()}, {cpu_text()}, {_cores()} cores",
             f"- torch {torch.__version__}, CUDA none"])
    out(["", "The SDPA kernel of each attention, under bf16 autocast, in one training step (forward, loss, "
         "backward) on the model's synthetic batches: *used* is the kernel op torch.profiler recorded under that "
         "attention kind's modules; *can run it* the backends that complete the step when they alone are "
         "allowed (`torch.nn.attention.sdpa_kernel([backend])` around that kind's modules only), with the first "
         "reason torch gave for each that cannot.", ""])
    out(md_table(["model", "attention", "used", "can run it", "cannot (torch's reason)"], []))
    for label, s in shapes(dry).items():
        try:
            torch.manual_seed(0)
            peer = P.Normlab(s, P.dropout("none"))
            peer.model.to(dev).train()
            batch = P.synthetic_batches(s, 1, dev)[0]
            used = sdpa_used(peer, batch, dev)
            for kind in ("encoder_self", "decoder_self", "cross"):
                ok, why = sdpa_eligible(peer, batch, dev, kind)
                kernels = ", ".join(f"{k} ({n} calls)" for k, n in used.get(kind, Counter()).most_common()) or "-"
                out([md_row([label, kind, kernels, ", ".join(ok) or "none",
                             "; ".join(f"{k}: {r}" for k, r in why.items()) or "-"])])
        except Exception as e:  # noqa: BLE001  (reported; the next model still runs)
            out([md_row([label, "-", failure(e), "-", "-"])])
            out.failed = True


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"


@contextlib.contextmanager
def around_attention(model, context_of):
    """Run each attention module's forward inside `context_of(kind)` (None: unchanged), through an
    instance attribute removed on exit; the model's code is not touched."""
    from normlab.model.attention import MultiheadAttention

    wrapped = []
    for m in model.modules():
        if isinstance(m, MultiheadAttention) and context_of(m.kind) is not None:
            def forward(*a, _f=m.forward, _kind=m.kind, **k):
                with context_of(_kind):
                    return _f(*a, **k)
            m.forward = forward
            wrapped.append(m)
    try:
        yield
    finally:
        for m in wrapped:
            del m.forward


def _train_step(peer, batch, dev) -> None:
    with amp(dev):
        loss = peer.loss(batch)
    loss.backward()
    peer.model.zero_grad(set_to_none=True)


def sdpa_used(peer, batch, dev) -> dict[str, Counter]:
    """{attention kind: Counter(kernel)}: the SDPA kernel ops the profiler saw under each kind's label."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with around_attention(peer.model, lambda kind: record_function(f"gpu_check:{kind}")):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _train_step(peer, batch, dev)
    used: dict[str, Counter] = {}
    for e in prof.events():
        if e.name in KERNEL_OPS:
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith("gpu_check:"):
                parent = parent.cpu_parent
            kind = parent.name.split(":", 1)[1] if parent is not None else "unlabelled"
            used.setdefault(kind, Counter())[KERNEL_OPS[e.name]] += 1
    return used


def sdpa_eligible(peer, batch, dev, kind: str) -> tuple[list[str], dict[str, str]]:
    """The backends that run a training step of `kind`'s attentions when they alone are allowed, and
    for the others the first reason torch gave (its warnings, else the error)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ok, why = [], {}
    for name, short in BACKENDS.items():
        backend = getattr(SDPBackend, name, None)
        if backend is None:  # an older torch without this backend
            continue
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                with around_attention(peer.model, lambda k: sdpa_kernel([backend]) if k == kind else None):
                    _train_step(peer, batch, dev)
                ok.append(short)
            except RuntimeError as e:
                why[short] = _reason([str(w.message) for w in seen], str(e))
        peer.model.zero_grad(set_to_none=True)
    return ok, why


def _reason(messages: list[str], error: str) -> str:
    # torch warns "<kernel> not used because:" and then the reasons, one warning each; the generic
    # lines and the "disabled" ones (our restriction did that) say nothing about the model.
    useful = []
    for m in messages:
        m = re.sub(r"\s*\(Triggered internally at .*\)\s*$", "", m.strip(), flags=re.S).strip()
        if m and not m.endswith("because:") and "disabled" not in m and m not in useful:
            useful.append(m)
    text = useful[0] if useful else error.strip().splitlines()[0]
    if text.startswith("No viable backend"):  # torch's generic error when the one allowed kernel declines
        text = "declined these inputs on this device (torch gave no reason)"
    return (text[:117] + "...") if len(text) > 120 else text


# ---- the command ------------------------------------------------------------------------------------
def _lightning(name: str):  # parts b and d (gpu_train.py), c and e (gpu_speed.py)
    def part(dry: bool, work: Path, out) -> None:
        import gpu_train

        gpu_train.PARTS[name](dry, work, out)
    return part


def _loops(name: str):
    def part(dry: bool, work: Path, out) -> None:
        import gpu_speed

        gpu_speed.PARTS[name](dry, work, out)
    return part


PARTS = {"device": device_part, "train": _lightning("train"), "speed": _loops("speed"),
         "precision": _lightning("precision"), "peers": _loops("peers")}


class Section:
    """The part's section: lines appended to `path` as they come; `failed` set by a measurement that
    failed while the part went on (the part then exits 1)."""

    def __init__(self, path: Path):
        self.path, self.failed = path, False

    def __call__(self, lines: list[str]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=PARTS)
    ap.add_argument("--result", type=Path, required=True, help="the part's section is appended here")
    ap.add_argument("--work", type=Path, default=Path("."), help="a folder for the part's runs and files")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        torch.set_num_threads(1)  # tiny models on a shared CI machine: more threads only wait
    out = Section(args.result)
    PARTS[args.part](args.dry_run, args.work, out)
    return 1 if out.failed else 0


if __name__ == "__main__":
    sys.exit(main())
