"""Which CPU ran a run, for results.json (`device`, `cpu`) and the studies' Cost sections.

fp32 results are the same to the bit only for the same code, seed and thread count on the same kernel
path: torch's vectorised ATen kernels are chosen by the CPU's capability (AVX-512, AVX2 or the
`default` scalar path, overridable with ATEN_CPU_CAPABILITY), and MKL's GEMMs and oneDNN's primitives
by the instruction set they detect (MKL_CBWR / MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA override
them). Another path sums in another order: 1e-8 to 3e-6 relative after a forward and backward
(tests/test_schemes_pinned.py), which deep post-LN amplifies into another stall step (issue 34). A
record names its path so that a rerun knows whether it should match it exactly.
"""
from __future__ import annotations

import os
import platform
import re
from functools import lru_cache

# The SIMD families oneDNN and MKL dispatch on, best first (/proc/cpuinfo flag -> name).
_ISA = [("amx_tile", "avx512_core_amx"), ("avx512f", "avx512_core"), ("avx2", "avx2"), ("avx", "avx"),
        ("sse4_2", "sse4.2")]
# What overrides a library's own choice of kernels, by library.
OVERRIDES = {"aten": ("ATEN_CPU_CAPABILITY",), "mkl": ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS"),
             "onednn": ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}


def _cpuinfo() -> tuple[str | None, set[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (Linux), else platform's name and no flags."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return (platform.processor() or None), set()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return (model.group(1).strip() if model else platform.processor() or None), set(flags.group(1).split()) if flags else set()


def _versions(config: str) -> dict[str, str | None]:
    """MKL's and oneDNN's versions from torch.__config__.show()."""
    mkl = re.search(r"Math Kernel Library Version ([\d.]+)", config)
    dnn = re.search(r"MKL-DNN v([\d.]+)", config)
    return {"mkl": mkl.group(1) if mkl else None, "onednn": dnn.group(1) if dnn else None}


def _chosen(library: str, default: str) -> str:
    """A library's kernel choice: the override set in the environment, else its own detection."""
    set_ = [f"{name}={os.environ[name]}" for name in OVERRIDES[library] if os.environ.get(name)]
    return ", ".join(set_) if set_ else default


@lru_cache(maxsize=1)
def cpu_info() -> dict:
    """results.json `cpu`: {"model", "isa" (the best SIMD family the CPU has), "capability" (torch's
    ATen kernels in use), "mkl", "onednn" (version and what chose their kernels: "auto" is the
    library's own detection, which follows "isa")}. The libraries' exact branch is not exported by
    torch's build: where no override is set it is the CPU's, so `isa` stands for it."""
    import torch

    model, flags = _cpuinfo()
    isa = next((name for flag, name in _ISA if flag in flags), None)
    versions = _versions(torch.__config__.show())
    return {"model": model, "isa": isa, "capability": torch.backends.cpu.get_cpu_capability(),
            "mkl": f"{versions['mkl']}, {_chosen('mkl', 'auto')}" if versions["mkl"] else None,
            "onednn": f"{versions['onednn']}, {_chosen('onednn', 'auto')}" if versions["onednn"] else None}


def cpu_text(info: dict | None = None) -> str:
    """The CPU in a few words, for `device` and the Cost sections: "AMD EPYC, AVX2 kernels"."""
    info = info if info is not None else cpu_info()
    overrides = [o for lib in ("mkl", "onednn") for o in [(info.get(lib) or "").partition(", ")[2]] if o and o != "auto"]
    return (f"{info.get('model') or 'unknown CPU'}, {info.get('capability') or '?'} kernels"
            + (f" ({'; '.join(overrides)})" if overrides else ""))


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have ended (data-loader
    workers): what a run used of the machine, whatever else shared it (issue 36). Windows has no
    `resource`: the process's own time only."""
    try:
        import resource
    except ImportError:
        import time

        return time.process_time()
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _cores() -> int:
    # the cores this process may run on (a container's or a SLURM job's share), not the host's count
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_text(trainer) -> str:
    """What trained the run, for results.json and the studies' cost lines: e.g. "cpu: x86_64, AMD
    EPYC, AVX2 kernels, 2 cores, 2 threads" (the kernel path decides the rounding: above) or
    "cuda: NVIDIA A100-SXM4-40GB x 4" (one per process)."""
    import torch

    dev = trainer.strategy.root_device
    what = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else f"{platform.machine()}, {cpu_text()}, {_cores()} cores, {torch.get_num_threads()} thread"
                 + ("s" if torch.get_num_threads() != 1 else ""))
    return f"{dev.type}: {what}" + (f" x {trainer.world_size}" if trainer.world_size > 1 else "")
