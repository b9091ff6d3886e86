"""results.json names the CPU and the kernel path that ran (hardware.py, issue 34): another path
rounds fp32 otherwise, so a rerun must know whether it should match a record to the bit."""
import json
import subprocess
import sys

import torch

from normlab import hardware
from normlab.study.readme import machine_share


def _in_child(env: dict) -> dict:
    code = "import json; from normlab.hardware import cpu_info, cpu_text; print(json.dumps([cpu_info(), cpu_text()]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in __import__("os").environ.items() if k not in _ALL} | env)
    return json.loads(out.stdout)


_ALL = {name for names in hardware.OVERRIDES.values() for name in names}


def test_the_kernel_path_and_its_overrides_are_named():
    native, text = _in_child({})  # none of the overrides set (the second CI pass sets them here)
    assert native["capability"] != "DEFAULT"
    assert native["mkl"].endswith(", auto") and native["onednn"].endswith(", auto")
    assert text == f"{native['model']}, {native['capability']} kernels"
    other, text = _in_child({"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"})
    assert (other["capability"], other["model"], other["isa"]) == ("DEFAULT", native["model"], native["isa"])
    assert other["mkl"].endswith(", MKL_CBWR=COMPATIBLE") and other["onednn"].endswith(", ONEDNN_MAX_CPU_ISA=SSE41")
    assert text == f"{native['model']}, DEFAULT kernels (MKL_CBWR=COMPATIBLE; ONEDNN_MAX_CPU_ISA=SSE41)"


def test_cpuinfo_and_versions_are_read_as_written(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz\n"
                    "flags\t\t: fpu sse4_2 avx avx2 avx512f avx512bw\n\nprocessor\t: 1\nmodel name\t: ignored\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(info if p == "/proc/cpuinfo" else p, *a, **k))
    model, flags = hardware._cpuinfo()
    assert model == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz" and {"avx2", "avx512f"} <= flags
    config = "  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build\n  - Intel(R) MKL-DNN v3.12.0 (Git"
    assert hardware._versions(config) == {"mkl": "2024.2", "onednn": "3.12.0"}
    assert hardware._versions("no BLAS") == {"mkl": None, "onednn": None}


def test_the_machine_share_reads_the_new_device_text():
    # the Cost sections read the cores and threads back from `device`; older records have no CPU named
    new = "cpu: x86_64, Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz, AVX512 kernels, 2 cores, 1 thread"
    assert machine_share({"device": new, "study": {"jobs": 1}}) == 0.5
    assert machine_share({"device": new.replace("1 thread", "2 threads")}) == 1.0
