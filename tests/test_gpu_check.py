"""The prepared GPU check (benchmarks/gpu_check.sh, issue 36): its dry run through the shell script, the
one-line refusal without CUDA, and a part that fails or hangs reported while the others run. The script's
runs are integration tests (its dry run trains through the entry point: tests/pyramid.py, TRAINING_BENCHMARKS)."""
from __future__ import annotations

import importlib.util
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def script(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def number(cell: str) -> float:
    return float(cell.replace(",", "").split()[0])


def table(text: str, title: str) -> list[list[str]]:
    """The rows (cells) of the first Markdown table after the line starting with `title`."""
    lines = text[text.index(title):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    t0 = time.monotonic()
    proc = script("--dry-run", env={"OUT": str(out)})
    return proc, out, time.monotonic() - t0


def test_dry_run_reports_every_part_to_stdout_and_to_out(dry_run):
    proc, out, seconds = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "gpu_check.out").read_text()
    assert report.strip() == proc.stdout.strip()  # the same text in both places
    assert "**DRY RUN**" in report
    for part in gpu_check.PARTS:
        assert re.search(rf"^### {re.escape(part.title)} \(ok: [\d.]+ s of \d+ s\)$", report, re.M), part.name
    assert "5 of 5 parts ran to the end" in report
    assert (out / "gpu_check.log").stat().st_size > 0  # the parts' own output, beside the report
    print(f"dry run: {seconds:.1f} s")


def test_dry_run_numbers(dry_run):
    report = dry_run[0].stdout
    sdpa = table(report, "### a.")
    # one row per model and attention kind; each attention's kernel once per layer (3+3 and 2+2 layers
    # in the dry run: peers.tiny_shape's layers, and deep_bleu's model at 2+2)
    assert [(r[0], r[1]) for r in sdpa] == [(m, k) for m in ("default", "12+12 d 64")
                                            for k in ("encoder_self", "decoder_self", "cross")]
    for row, layers in zip(sdpa, [3] * 3 + [2] * 3):  # torch 2.13's CPU picks its flash kernel; math would do
        assert re.fullmatch(rf"(flash \(CPU\)|math) \({layers} calls\)", row[2]), row
        assert "math" in row[3].split(", ")  # the math kernel runs anything

    train = table(report, "### b.")
    assert len(train) == 2
    for row in train:
        assert row[3] == "bf16-mixed, foreach"  # trainer=gpu's precision; foreach Adam on CPU (fused on CUDA)
        assert row[4] == "2-3"
        assert all(number(row[i]) > 0 for i in (2, 5, 6, 7, 8, 9))
        # ms/step and tokens/s are two views of one clock: tokens/s x s/step = tokens per step > 0
        assert number(row[5]) * number(row[6]) / 1e3 > 1

    adam = table(report, "#### Fused Adam")
    assert [r[0] for r in adam] == ["fused", "foreach", "for-loop"]
    assert number(adam[0][4]) == 1.0 and all(number(r[i]) > 0 for r in adam for i in (1, 2, 3, 4))
    comp = table(report, "#### torch.compile")
    assert [r[0] for r in comp] == ["eager", "compiled"] and number(comp[0][4]) == 1.0
    assert re.search(r"^Compilation: -?[\d.]+ s", report, re.M)

    prec = table(report, "### d.")
    assert [r[0] for r in prec] == ["bf16-mixed", "32-true"]
    (bf1, bf3), (fp1, fp3) = [(number(r[1]), number(r[2])) for r in prec]
    m = re.search(r"bf16-mixed - fp32 at step 3: ([+-][\d.]+) \(([+-][\d.]+)% of fp32\).*at step 1 .*: ([+-][\d.]+)\.",
                  report)
    assert m, report
    diff, rel, diff1 = (float(g) for g in m.groups())
    assert diff == pytest.approx(bf3 - fp3, abs=2e-4)  # the line's arithmetic, from the table's rounded losses
    assert rel == pytest.approx(100 * diff / fp3, abs=0.01)
    assert diff1 == pytest.approx(bf1 - fp1, abs=2e-4)
    assert abs(bf1 - fp1) < 0.05 * fp1  # the same initial weights and batch: only rounding differs

    peers = table(report, "#### Shape small")
    assert [r[0] for r in peers] == ["papers", "none", "none_model"]
    xt_missing = importlib.util.find_spec("x_transformers") is None
    assert ("**x-transformers: missing**" in report) == xt_missing
    for r in peers:
        assert number(r[1]) > 0 and number(r[3]) > 0  # normlab, torch.nn.Transformer
        assert (r[2] == "missing") == xt_missing
        assert re.fullmatch(r"[\d.]+ \[[\d.]+, [\d.]+\]", r[4])


@pytest.mark.integration
def test_the_check_refuses_to_run_without_cuda(tmp_path):
    proc = script(env={"OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: device: no CUDA device"), proc.stderr
    assert "(allowed: --dry-run on CPU)" in lines[0]
    assert not (tmp_path / "gpu_check.out").exists()


@pytest.mark.parametrize("args, expected", [
    (["--dry-run", "--parts", "device,nope"], "error: --parts: nope (allowed: device, train, speed, precision, peers)"),
    (["--dry-run", "--budget", "0"], "error: --budget: 0: must be > 0 seconds"),
    (["--dry-run", "--steps", "3"], "error: benchmarks/gpu_check.sh: unrecognized arguments: --steps 3"),
])
def test_a_bad_argument_is_one_line(args, expected, capsys):
    assert gpu_check.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(expected), err


# ---- the parts' processes: a part that fails or hangs is reported, and the next part runs ----------
def fake_part(name: str, result: str, work: str, dry: bool, log: str) -> None:
    gpu_check.isolate(log)
    if name == "device":  # fails after measuring something
        Path(result).write_text("- measured before failing: 1.0\n")
        os.write(2, b"the device part's last words\n")  # fd 2: what C code and tracebacks write to
        sys.exit(3)
    if name == "train":  # hangs, and has started a process of its own
        child = subprocess.Popen(["sleep", "60"])
        Path(work, "grandchild.pid").write_text(str(child.pid))
        time.sleep(60)
    Path(result).write_text(f"- {name}: fine\n")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")  # a zombie has ended


def test_a_failing_and_a_hanging_part_are_reported_and_the_others_run(tmp_path, monkeypatch):
    parts = [gpu_check.Part("device", "a. dev", 10, 10), gpu_check.Part("train", "b. train", 2, 2),
             gpu_check.Part("speed", "c. speed", 10, 10)]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(gpu_check.tempfile, "mkdtemp", lambda prefix: str(work))
    monkeypatch.setattr(gpu_check.shutil, "rmtree", lambda *a, **k: None)  # keep the grandchild's pid file
    report = gpu_check.Report(tmp_path / "r.out")
    t0 = time.monotonic()
    statuses = gpu_check.run_all(parts, True, 100, time.monotonic(), report, multiprocessing.get_context("fork"),
                                 fake_part)
    assert time.monotonic() - t0 < 30  # the hanging part was stopped at its 2 s cap (+ 5 s grace at most)
    assert statuses == {"device": "exit 3", "train": "timeout", "speed": "ok"}
    text = (tmp_path / "r.out").read_text()
    assert re.search(r"^### a\. dev \(FAILED, exit 3: [\d.]+ s of 10 s\)$", text, re.M)
    assert "- measured before failing: 1.0" in text and "the device part's last words" in text
    assert re.search(r"^### b\. train \(TIMED OUT at its cap: [\d.]+ s of 2 s\)$", text, re.M)
    assert "- speed: fine" in text
    pid = int((work / "grandchild.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the timed-out part's own child outlived it"


def test_parts_beyond_the_budget_are_not_run(tmp_path):
    parts = [gpu_check.Part("device", "a. dev", 10, 10)]
    report = gpu_check.Report(tmp_path / "r.out")
    started = time.monotonic() - 98  # 2 s of a 100 s budget left: less than a part needs to start
    statuses = gpu_check.run_all(parts, True, 100, started, report, multiprocessing.get_context("fork"), fake_part)
    assert statuses == {"device": "skipped"}
    assert re.search(r"^### a\. dev \(NOT RUN: [12] s of the 100 s budget left\)$", report.path.read_text(), re.M)


def test_sdpa_used_names_the_kernel_of_each_attention_kind():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import gpu_parts
    import peers as P

    s = gpu_parts.shapes(dry=True)["default"]
    torch.manual_seed(0)
    peer = P.Normlab(s, P.dropout("none"))
    batch = P.synthetic_batches(s, 1, "cpu")[0]
    dev = torch.device("cpu")
    with sdpa_kernel([SDPBackend.MATH]):  # every attention on the math kernel: another op name, the same counts
        used = gpu_parts.sdpa_used(peer, batch, dev)
    assert {k: dict(v) for k, v in used.items()} == {k: {"math": s.layers} for k in ("encoder_self", "decoder_self",
                                                                                      "cross")}
    # restricting one kind: only that kind's attentions are held to the backend
    ok, why = gpu_parts.sdpa_eligible(peer, batch, dev, "cross")
    assert "math" in ok and "efficient" in why


def test_reason_keeps_torchs_own_words():
    from gpu_parts import _reason

    msgs = ["Memory efficient kernel not used because: (Triggered internally at sdp_utils.cpp:123.)",
            "Memory Efficient attention has been disabled. (Triggered internally at x.cpp:1.)",
            "Both fused kernels do not support non-null attn_mask. (Triggered internally at y.cpp:2.)"]
    assert _reason(msgs, "No available kernel.") == "Both fused kernels do not support non-null attn_mask."
    assert _reason([], "No viable backend for scaled_dot_product_attention was found.\nmore") == \
        "declined these inputs on this device (torch gave no reason)"


def test_a_failing_measurement_is_a_line_and_the_part_goes_on(tmp_path, monkeypatch):
    import gpu_parts
    import gpu_speed

    def broken(dry, work, out):
        out(["- started"])
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    monkeypatch.setattr(gpu_speed, "adam_part", broken)
    monkeypatch.setattr(gpu_speed, "compile_part", lambda dry, work, out: out(["- compiled: 1.0"]))
    result = tmp_path / "speed.md"
    assert gpu_parts.main(["speed", "--dry-run", "--result", str(result), "--work", str(tmp_path)]) == 1
    text = result.read_text()
    assert "- started\nFAILED: RuntimeError: CUDA error: an illegal memory access was encountered\n" in text
    assert text.index("#### torch.compile") > text.index("FAILED") and text.rstrip().endswith("- compiled: 1.0")
