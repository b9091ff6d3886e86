"""Parts b and d of the GPU check (gpu_check.py): normlab's own training path, what
`python train.py trainer=gpu ...` runs (normlab.train.run on the composed config, in this process),
on the bundled corpus, timed by a callback.

b. make train's model (conf defaults) and deep_bleu's model (conf/study/deep_bleu.yaml's `common`
   overrides: 12+12 layers, d 64, FFN 256) with trainer=gpu (bf16-mixed; fused Adam, lit_module.py):
   target tokens/s over the training steps after the first ones (data loading and Lightning's loop
   included, validation excluded) and the allocator's peak over training steps.
d. The default model for 200 steps with trainer=gpu and again with trainer.precision=32-true: the same
   seed, so the same initial weights and the same batches in the same order; the training loss of each
   step.

Every run trains only: no validation (trainer.limit_val_batches=0), no checkpoints, no final passes,
CSV logging (no W&B: the GPU machine has no network), in a folder under --work. --dry-run: the same
runs on CPU (trainer.accelerator=cpu, still bf16-mixed) with a tiny model on a few hundred sentences
of the corpus, 3 steps.
"""
from __future__ import annotations

import gzip
import json
import resource
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from gpu_parts import failure, md_row, md_table

ROOT = Path(__file__).resolve().parents[1]


class StepClock(Callback):
    """Times training steps `skip`+1 .. the last (CUDA: synchronised at the first timed step's start
    and at the end, not per step, so the host runs ahead as in any run), counts their target tokens,
    keeps the allocator's peak over training steps (reset at each step's start: validation and
    setup do not count) and each step's training loss per target token (device tensors, read once at
    the end). Writes them to `path` as JSON when training ends."""

    def __init__(self, path: str, skip: int = 0):
        self.path, self.skip = Path(path), int(skip)
        self.t0, self.tokens, self.steps, self.peak = None, 0, 0, 0
        self.losses: list = []

    def _cuda(self, module) -> bool:
        return module.device.type == "cuda"

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.skip and self.t0 is None:
            if self._cuda(module):
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()
        if self._cuda(module):
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss, _, ntok = module.stats.step_sums  # sums over the batch's target tokens (lit_module.TrainStats)
        self.losses.append(loss.float() / max(ntok, 1))
        if self.t0 is not None:
            self.tokens += ntok
            self.steps += 1
        if self._cuda(module):
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())

    def on_train_end(self, trainer, module) -> None:
        if self._cuda(module):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.t0 if self.t0 is not None else float("nan")
        opt = trainer.optimizers[0]
        adam = "fused" if opt.defaults.get("fused") else "foreach" if opt.defaults.get("foreach") else "default"
        self.path.write_text(json.dumps({
            "timed_steps": self.steps, "tokens": self.tokens, "seconds": seconds,
            "tokens_per_s": self.tokens / seconds if self.steps else float("nan"),
            # CPU (the dry run): the process's peak resident memory, not tensors alone
            "peak_mib": self.peak / 2 ** 20 if self._cuda(module) else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "losses": [float(x) for x in torch.stack(self.losses).cpu()] if self.losses else [],
            "adam": adam, "precision": str(trainer.precision),
            "fp32_matmul_precision": torch.get_float32_matmul_precision()}))


# Training only: no validation, checkpoints or final passes; CSV logs (as conf/debug does, on the GPU)
TRAIN_ONLY = ["trainer=gpu", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "logger=csv",
              "eval.valid_bleu=false", "eval.test=false", "eval.test_greedy=false", "eval.test_average=false",
              "callbacks.step_checkpoints.keep_last_n=0", "callbacks.checkpoint.save_top_k=0",
              "callbacks.checkpoint.save_last=false", "callbacks.full_checkpoint.every_n_steps=0", "retrain=true"]
# --dry-run: the same runs on CPU at d 32 on a few hundred sentences (deep_bleu's model at 2+2 layers)
DRY_DEEP = ["model.encoder_layers=2", "model.decoder_layers=2"]
DRY = ["trainer.accelerator=cpu", "model.d_model=32", "model.encoder_ffn=64", "model.decoder_ffn=64",
       "data.vocab_size=300", "data.max_tokens=512", "optim.warmup=4"]


def deep_overrides() -> list[str]:
    from omegaconf import OmegaConf

    return list(OmegaConf.load(ROOT / "conf/study/deep_bleu.yaml").common)


def small_corpus(work: Path) -> list[str]:
    """--dry-run: 600 training pairs (the bundled corpus's valid split), 40 valid and 40 test."""
    src, out = ROOT / "data" / "bible_de_en", work / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    over = [f"data.cache_dir={work / 'cache'}"]
    for split, origin, lo, hi in (("train", "valid", 0, 600), ("valid", "test", 0, 40), ("test", "test", 40, 80)):
        for lang, side in (("de", "src"), ("en", "tgt")):
            with gzip.open(src / f"{origin}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()[lo:hi]
            (out / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
            over.append(f"data.{split}_{side}={out / f'{split}.{lang}'}")
    return over


def train(tag: str, overrides: list[str], steps: int, skip: int, work: Path, dry: bool) -> dict:
    """One run of `train.py <overrides>` for `steps` steps, timed after `skip`: the clock's numbers,
    the run's parameters and wall time (setup and data preparation included)."""
    from hydra import compose, initialize_config_dir

    import normlab.resolvers  # noqa: F401  (the config's nl.* resolvers, as train.py registers them)
    from normlab.train import run

    clock = work / f"{tag}.clock.json"
    over = [*TRAIN_ONLY, *overrides, f"trainer.max_steps={steps}", f"name=gpu-check-{tag}",
            f"++run_dir={work / tag}", "+callbacks.gpu_check_clock._target_=gpu_train.StepClock",
            f"+callbacks.gpu_check_clock.path={clock}", f"+callbacks.gpu_check_clock.skip={skip}"]
    if dry:
        over += DRY + small_corpus(work)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=over)
    t0 = time.perf_counter()
    results = run(cfg)
    wall = time.perf_counter() - t0
    if results.get("status") not in ("completed",):
        raise RuntimeError(f"{tag}: the run ended {results.get('status')}: {results.get('error') or results}")
    return {**json.loads(clock.read_text()), "params": results["params"], "wall_s": wall,
            "device": results["device"], "run_tokens_per_s": results.get("train_tokens_per_s")}


def train_part(dry: bool, work: Path, out) -> None:
    out(["`python train.py trainer=gpu [the model's overrides] trainer.max_steps=N`, training only (no validation, "
         "checkpoints or final passes). Timed: the steps after the first ones (data loading and Lightning's loop "
         "included), synchronised at both ends; peak: the allocator's over each training step (the dry run: the "
         "process's peak RSS).", ""])
    out(md_table(["model", "overrides", "parameters", "precision, Adam", "steps timed", "tokens/s", "ms/step",
                  "peak MiB", "the run's train_tokens_per_s", "run s (setup included)"], []))
    devices = []
    for tag, label, over, (steps, skip) in (("default", "make train's (the defaults)", [], (300, 50)),
                                            ("deep", "deep_bleu's 12+12, d 64", deep_overrides(), (200, 50))):
        steps, skip = (3, 1) if dry else (steps, skip)
        over = over + DRY_DEEP if dry and tag == "deep" else over
        try:
            r = train(tag, over, steps, skip, work, dry)
        except Exception as e:  # noqa: BLE001  (reported; the next model still runs)
            out([md_row([label, " ".join(over) or "-", failure(e), *["-"] * 7])])
            out.failed = True
            continue
        out([md_row([label, " ".join(over) or "-", f"{r['params']:,}", f"{r['precision']}, {r['adam']}",
                     f"{skip + 1}-{steps}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['seconds'] / max(r['timed_steps'], 1) * 1e3:.1f}", f"{r['peak_mib']:,.0f}",
                     f"{r['run_tokens_per_s']:,.0f}", f"{r['wall_s']:.1f}"])])
        devices.append(r["device"])
    if devices:
        out(["", f"Trained on {devices[0]}."])


# what torch.set_float32_matmul_precision's settings make of an fp32 matmul on a GPU with tensor cores
MATMUL = {"highest": "torch's default: fp32, no TF32", "high": "TF32", "medium": "bf16"}


def precision_part(dry: bool, work: Path, out) -> None:
    steps = 3 if dry else 200
    runs = {p: train(f"precision-{p}", [f"trainer.precision={p}"], steps, 0, work, dry)
            for p in ("bf16-mixed", "32-true")}
    bf, fp = runs["bf16-mixed"]["losses"], runs["32-true"]["losses"]
    last = max(1, min(20, steps // 10))  # the mean over the last tenth (20 of 200 steps)
    rows = []
    for p, r in runs.items():
        losses = r["losses"]
        rows.append([p, f"{losses[0]:.4f}", f"{losses[-1]:.4f}", f"{sum(losses[-last:]) / last:.4f}",
                     f"{r['tokens_per_s']:,.0f}"])
    mean_bf, mean_fp = sum(bf[-last:]) / last, sum(fp[-last:]) / last
    matmul = runs["32-true"]["fp32_matmul_precision"]
    out([f"make train's model, `train.py trainer=gpu trainer.max_steps={steps}` and the same with "
         "trainer.precision=32-true: seed 1 both, so the same initial weights and batches; the training loss per "
         f"target token (label-smoothed) of each step. fp32 matmuls at torch.get_float32_matmul_precision() "
         f"{matmul!r} ({MATMUL.get(matmul, 'see torch')}).", ""])
    out(md_table(["precision", "loss, step 1", f"loss, step {steps}", f"mean, steps {steps - last + 1}-{steps}",
                  "tokens/s (separate runs)"], rows))
    out(["", f"bf16-mixed - fp32 at step {steps}: {bf[-1] - fp[-1]:+.4f} ({(bf[-1] - fp[-1]) / fp[-1]:+.2%} of fp32); "
             f"over steps {steps - last + 1}-{steps}: {mean_bf - mean_fp:+.4f} ({(mean_bf - mean_fp) / mean_fp:+.2%}); "
             f"at step 1 (the same weights: rounding alone): {bf[0] - fp[0]:+.4f}."])


PARTS = {"train": train_part, "precision": precision_part}
