"""Lightning's loop overhead: normlab's Seq2SeqModule under `Trainer.fit` against a plain PyTorch
loop (forward, loss, backward, Adam, LR schedule) on the same model, weights and batches.

The model and batches are `make train`'s (conf/model/tiny.yaml + pre-norm, the bundled corpus at
max_tokens 2048); the Trainer is configured as conf/trainer/cpu.yaml (progress bar, a logger
every 25 steps) without validation or checkpoints, which are work, not loop overhead. The two
loops take turns for --rounds rounds (alternating which goes first); overhead = Lightning's
time / the plain loop's - 1 over the same steps (the first --warmup steps of each round untimed).

    python benchmarks/lightning_overhead.py [--steps 60] [--rounds 3]
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import normlab  # noqa: F401,E402
import torch  # noqa: E402

import peers as P  # noqa: E402


def _module(small: bool):
    from omegaconf import OmegaConf

    from normlab.lit_module import Seq2SeqModule
    from normlab.settings import EvalSpec, OptimSpec

    model = OmegaConf.to_container(OmegaConf.load(P.ROOT / "conf/model/tiny.yaml"))
    model.pop("defaults", None)
    model.pop("compile", None)  # a run option, not a model field (normlab.run_config.RUNTIME_MODEL_KEYS)
    if small:
        model.update(d_model=32, encoder_ffn=64, decoder_ffn=64, encoder_layers=1, decoder_layers=1)
    optim = OmegaConf.to_container(OmegaConf.load(P.ROOT / "conf/optim/adam_inverse_sqrt.yaml"))
    cfg = dict(model, vocab_size=1000 if small else 8000, norm={"placement": "pre"})
    return Seq2SeqModule(cfg, optim=OptimSpec.of(optim), eval=EvalSpec(valid_bleu=False))


class _Clock:
    # A Lightning callback and the plain loop's timer alike: a timestamp at each batch start.
    def __init__(self):
        self.starts: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args) -> None:
        self.starts.append(time.perf_counter())


def _lightning(module, batches, warmup: int, device: str) -> float:
    import logging
    import warnings

    import lightning as L

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")

    clock = type("ClockCallback", (_Clock, L.Callback), {})()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=len(batches),
                            logger=L.pytorch.loggers.CSVLogger(tmp), log_every_n_steps=25, callbacks=[clock],
                            enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                            enable_model_summary=False, enable_progress_bar=True, default_root_dir=tmp)
        loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
        trainer.fit(module, train_dataloaders=loader)
    return clock.starts[-1] - clock.starts[warmup]


def _plain(module, batches, warmup: int, device: str) -> float:
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    clock = _Clock()
    module.train()
    for b in batches:
        clock.on_train_batch_start()
        b = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
        loss, _, ntok, _ = module._loss(b)
        (loss / ntok).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    clock.on_train_end()
    return clock.starts[-1] - clock.starts[warmup]


def measure(steps: int = 60, rounds: int = 3, warmup: int = 5, small: bool = False, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    vocab = 1000 if small else 8000
    batches = [{k: b[k] for k in ("src", "tgt_in", "tgt_out", "ntokens")}
               for b in P.corpus_batches(steps if not small else 8, vocab, 2048, "cpu")]
    torch.manual_seed(0)
    ours = _module(small)
    plain = copy.deepcopy(ours).to(device)
    ratios = []
    for r in range(rounds):  # alternate which loop goes first, so a load trend favours neither
        if r % 2:
            t_p = _plain(plain, batches, warmup, device)
            t_l = _lightning(ours, batches, warmup, device)
        else:
            t_l = _lightning(ours, batches, warmup, device)
            t_p = _plain(plain, batches, warmup, device)
        ratios.append(t_l / t_p - 1.0)
    lo, med, hi = P.quantiles(ratios)
    tokens = sum(b["ntokens"] for b in batches[warmup:])
    print(f"\nLightning loop overhead over a plain loop ({len(batches)} steps x {rounds} rounds, make train's "
          f"model and batches, {tokens / t_p:,.0f} tok/s plain): median {100 * med:+.1f}% "
          f"(min {100 * lo:+.1f}%, max {100 * hi:+.1f}%)")
    return {"overhead_median": med, "overhead_min": lo, "overhead_max": hi, "rounds": rounds, "steps": len(batches)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    measure(a.steps, a.rounds, small=a.small, device=a.device)
