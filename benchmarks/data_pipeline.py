"""The data pipeline at corpus sizes up to WMT14 En-De's: preprocessing speed and size, time from
`python train.py` to the first optimizer step and the training process's memory, and data-loader
speed against what the reference model consumes; one command, a table and JSON.

    python benchmarks/data_pipeline.py                                   # 0.03M, 1M and 4M pairs
    python benchmarks/data_pipeline.py --sizes 0.003,0.01 --ddp 1 --out /tmp/dp.json   # a quick check

Corpora are synthetic, made from the bundled de-en training split: pair i is training pair
i mod 28,798, with " (c)" appended to both sides for its c-th repetition, so every line is
distinct (they are cached under --workdir). valid/test are the bundled ones. The tokenizer is
trained once (smallest corpus) and given to the preprocessing of every size, as the target
"1M pairs, tokenizer given" reads; sentencepiece's own time on each corpus (at most --spm-sample
lines) is reported beside it. Each train.py run is the default model on data=preprocessed,
trainer.max_steps=1 with validation and test off, timed from launch to the end of the first
optimizer step (a probe callback, this file's FirstStepProbe) with the peak RSS of every rank at
that moment, and under /usr/bin/time -v for the peak of the whole run. Data loading: batches/s
of the train loader (max_tokens 2048) against the batches/s a training step of the reference
model of benchmarks/train_throughput.py takes on the same batches.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "data" / "bible_de_en"


class FirstStepProbe(L.Callback):
    """Writes {rank, time, peak RSS} to <out>.rank<r>.json after the first optimizer step, with the
    peak RSS just before it (data, model and loader built: what the corpus size can change) and the
    first batch's shape (the step's own peak follows the shape of whichever batch comes first)."""

    def __init__(self, out: str):
        self.out, self.done, self.before, self.shape = out, False, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.before is None:
            self.before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            self.shape = [list(batch["src"].shape), list(batch["tgt_in"].shape)]

    def on_train_batch_end(self, trainer, *args) -> None:
        if not self.done:
            self.done = True
            rec = {"rank": trainer.global_rank, "time": time.time(), "peak_rss_mb_before": self.before,
                   "first_batch": self.shape,
                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **rss_parts()}
            Path(f"{self.out}.rank{trainer.global_rank}.json").write_text(json.dumps(rec))


def rss_parts() -> dict:
    """Resident memory split into anonymous (the process's own) and file-backed pages (the memory
    maps' pages: shared by the ranks through the page cache, dropped by the kernel under pressure)."""
    status = Path("/proc/self/status")
    if not status.exists():
        return {}
    fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if line.startswith("Rss"))
    return {f"{k.lower()}_mb": round(int(v.split()[0]) / 1024, 1) for k, v in fields.items() if k in ("RssAnon", "RssFile")}


def make_corpus(pairs: int, out: Path) -> Path:
    """Synthetic corpus of `pairs` distinct training pairs (cached), bundled valid/test."""
    done = out / "done"
    if done.is_file() and done.read_text() == str(pairs):
        return out
    out.mkdir(parents=True, exist_ok=True)
    base = {lang: gzip.decompress((BUNDLED / f"train.{lang}.gz").read_bytes()).decode().splitlines()
            for lang in ("de", "en")}
    n = len(base["de"])
    for lang in ("de", "en"):
        with open(out / f"train.{lang}", "w", encoding="utf-8") as f:
            for start in range(0, pairs, n):
                c = start // n
                suffix = f" ({c})" if c else ""
                f.write("".join(line + suffix + "\n" for line in base[lang][:min(n, pairs - start)]))
        for split in ("valid", "test"):
            (out / f"{split}.{lang}").write_bytes(gzip.decompress((BUNDLED / f"{split}.{lang}.gz").read_bytes()))
    done.write_text(str(pairs))
    return out


def preprocess(corpus: Path, out: Path, spm_model: Path | None, workers: int) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "normlab.commands.preprocess", "--src-lang", "de", "--tgt-lang", "en",
           "--out", str(out), "--force", "--workers", str(workers), "-q"]
    cmd += [a for s in ("train", "valid", "test") for a in (f"--{s}pref", str(corpus / s))]
    cmd += ["--spm-model", str(spm_model)] if spm_model else []
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, json.loads((out / "manifest.json").read_text())


def spm_seconds(corpus: Path, pairs: int, sample: int) -> float:
    from normlab.data.preprocess import sample_training_lines
    from normlab.data.tokenizer import Tokenizer

    t0 = time.perf_counter()
    lines = sample_training_lines((corpus / "train.de", corpus / "train.en"), (pairs, pairs), sample, 1)
    Tokenizer.train(lines, 8000)
    return time.perf_counter() - t0


def first_step(folder: Path, devices: int, probe: Path) -> dict:
    overrides = [f"data=preprocessed", f"data.path={folder}", "trainer.max_steps=1", "logger=none",
                 "eval.test=false", "eval.valid_bleu=false", "trainer.limit_val_batches=0",
                 "trainer.enable_progress_bar=false", f"hydra.run.dir={probe.parent / ('run-' + probe.name)}", "retrain=true",
                 "+callbacks.bench_probe._target_=data_pipeline.FirstStepProbe", f"+callbacks.bench_probe.out={probe}"]
    if devices > 1:
        overrides += ["trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={devices}", "trainer.precision=32-true"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))}
    timer = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").exists() else []
    t0 = time.time()
    proc = subprocess.run([*timer, sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode:
        raise RuntimeError(f"train.py failed:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(Path(f"{probe}.rank{r}.json").read_text()) for r in range(devices)]
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return {"devices": devices, "seconds_to_first_step": round(max(r["time"] for r in ranks) - t0, 2),
            "peak_rss_mb_before_first_step": round(max(r["peak_rss_mb_before"] for r in ranks), 1),
            "peak_rss_mb_at_first_step": round(max(r["peak_rss_mb"] for r in ranks), 1),
            "first_batch_src_tgt": ranks[0]["first_batch"],
            "rss_anon_mb_at_first_step": max(r.get("rssanon_mb", 0) for r in ranks),
            "rss_file_mb_at_first_step": max(r.get("rssfile_mb", 0) for r in ranks),
            "peak_rss_mb_whole_run": round(int(peak.group(1)) / 1024, 1) if peak else None,
            "seconds_to_exit": round(wall, 2)}


def loader_rate(folder: Path, batches: int) -> dict:
    from normlab.data.datamodule import TranslationDataModule

    t0 = time.perf_counter()
    dm = TranslationDataModule(path=str(folder), max_tokens=2048, max_positions=256)
    dm.setup("fit")
    loader = dm.train_dataloader()
    setup = time.perf_counter() - t0
    t0, n, tokens = time.perf_counter(), 0, 0
    for b in loader:
        n, tokens = n + 1, tokens + b["ntokens"]
        if n == batches:
            break
    seconds = time.perf_counter() - t0
    return {"setup_seconds": round(setup, 2), "batches_per_s": round(n / seconds, 1),
            "target_tokens_per_s": round(tokens / seconds), "batches": n, **rss_parts()}


def model_rate(folder: Path, steps: int) -> dict:
    """Training steps/s of the reference model (train_throughput.py) on the loader's batches."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from peers import SETTINGS, Normlab, Shape

    from normlab.data.datamodule import TranslationDataModule

    dm = TranslationDataModule(path=str(folder), max_tokens=2048, max_positions=256)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    batches = [next(it) for _ in range(steps + 1)]
    ours = Normlab(Shape(vocab=dm.tokenizer.vocab_size), SETTINGS["none"])
    opt = torch.optim.Adam(ours.model.parameters(), lr=1e-4)
    for i, b in enumerate(batches):
        if i == 1:  # the first step warms up
            t0, tokens = time.perf_counter(), 0
        opt.zero_grad()
        ours.loss(b).backward()
        opt.step()
        if i:
            tokens += b["ntokens"]
    seconds = time.perf_counter() - t0
    return {"batches_per_s": round(steps / seconds, 3), "target_tokens_per_s": round(tokens / seconds)}


def table(results: dict) -> str:
    rows = ["| train pairs | preprocess pairs/s | bytes/pair on disk | spm s (sample) | devices | s to 1st step "
            "| peak RSS MB before 1st step | peak RSS MB after it (anon + file) [1st batch] | peak RSS MB whole run "
            "| loader batches/s | loader / model |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    model = results["reference_model"]["batches_per_s"]
    for r in results["sizes"]:
        for t in r["train"]:
            rows.append(f"| {r['pairs']:,} | {r['preprocess_pairs_per_s']:,.0f} | {r['bytes_per_pair']:.1f} | "
                        f"{r['spm_seconds']:.1f} | {t['devices']} | {t['seconds_to_first_step']:.1f} | "
                        f"{t['peak_rss_mb_before_first_step']:.0f} | "
                        f"{t['peak_rss_mb_at_first_step']:.0f} ({t['rss_anon_mb_at_first_step']:.0f} + "
                        f"{t['rss_file_mb_at_first_step']:.0f}) [{'x'.join(map(str, t['first_batch_src_tgt'][1]))}] | "
                        f"{t['peak_rss_mb_whole_run'] or float('nan'):.0f} | "
                        f"{r['loader']['batches_per_s']:,.0f} | {r['loader']['batches_per_s'] / model:,.0f}x |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--sizes", default="0.03,1,4", help="millions of training pairs (default: 0.03,1,4)")
    ap.add_argument("--ddp", default="1,2", help="processes per train.py run (default: 1,2)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="preprocessing processes")
    ap.add_argument("--spm-sample", type=int, default=1_000_000)
    ap.add_argument("--loader-batches", type=int, default=2000)
    ap.add_argument("--model-steps", type=int, default=5)
    ap.add_argument("--workdir", default=str(ROOT / ".cache" / "bench-data"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "data_pipeline.json"))
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    sizes = sorted(int(float(s) * 1e6) for s in args.sizes.split(","))
    devices = [int(d) for d in args.ddp.split(",")]
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
                     "workers": args.workers, "sizes": []}
    spm_model = None
    for pairs in sizes:
        corpus = make_corpus(pairs, work / f"corpus-{pairs}")
        folder = work / f"bin-{pairs}"
        seconds, manifest = preprocess(corpus, folder, spm_model, args.workers)
        spm_model = spm_model or folder / "spm.model"
        train_bytes = sum(s["bytes"] for k, s in manifest["arrays"].items() if k.startswith("train."))
        row = {"pairs": pairs, "preprocess_seconds": round(seconds, 2),
               "preprocess_pairs_per_s": round(sum(s["lines"] for s in manifest["splits"].values()) / seconds),
               "bytes_per_pair": round(train_bytes / pairs, 1),
               "spm_seconds": round(spm_seconds(corpus, pairs, args.spm_sample), 2),
               "loader": loader_rate(folder, args.loader_batches),
               "train": [first_step(folder, d, work / f"probe-{pairs}-{d}") for d in devices]}
        results["sizes"].append(row)
        print(json.dumps(row), file=sys.stderr)
    results["reference_model"] = model_rate(work / f"bin-{sizes[0]}", args.model_steps)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"reference model (train_throughput.py): {results['reference_model']}; -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
