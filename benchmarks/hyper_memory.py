"""Memory, parameters and step time of hyper-connections (model.residual, issue 20): training steps
of pre-LN with the plain residual (add) and with n residual streams (hyper static / dynamic, mHC),
pre-norm (the placement hyper-connections take), no dropout, at one of two shapes:
  reference    the benchmarks' reference config (peers.Shape: 6+6 layers, d 256, FFN 1024, 8k tied
               vocabulary, batches of 128 x 32 tokens)
  deep_recent  the deep_recent study's model (12+12 layers, d 64, FFN 256, 4 heads; 64 x 32 tokens,
               its 2,048-token batches), where the mixing, not the matmuls, sets the step time

Prints the parameter count and the peak bytes live in one step (parameters, gradients, Adam
state, activations; CPU: tensor storages, peers.LiveBytes; CUDA: the allocator's peak), and the
median of --steps step times, the models taking turns step by step (so a busy moment slows all
of them alike), with its ratio to add's in the same run.

    .venv/bin/python benchmarks/hyper_memory.py                       # the reference config (~2 min on 2 cores)
    .venv/bin/python benchmarks/hyper_memory.py --shape deep_recent   # the study's model (~1 min)
    .venv/bin/python benchmarks/hyper_memory.py --shape small --steps 1   # check the script (seconds)
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers as P  # noqa: E402

VARIANTS = {"add": {}, "hyper n=4 static": dict(residual="hyper"),
            "hyper n=4 dynamic": dict(residual="hyper", residual_mixing="dynamic"),
            "mhc n=4 dynamic": dict(residual="mhc", residual_mixing="dynamic")}


class PreNorm(P.Normlab):
    # peers.Normlab's model and loss, pre-norm and with the variant's residual.
    def __init__(self, s: P.Shape, residual: dict):
        from normlab.config import ModelConfig, NormConfig
        from normlab.model.transformer import Seq2SeqTransformer

        cfg = ModelConfig(vocab_size=s.vocab, d_model=s.d, encoder_layers=s.layers, decoder_layers=s.layers,
                          encoder_heads=s.heads, decoder_heads=s.heads, encoder_ffn=s.ffn, decoder_ffn=s.ffn,
                          norm=NormConfig(placement="pre"), **residual)
        self.model = self.forward = Seq2SeqTransformer(cfg)


def deep_recent_shape() -> P.Shape:
    # deep_recent's model: conf/study/deep_recent.yaml's `common` overrides (read, so the two cannot
    # drift apart) on conf/model/tiny.yaml (peers.tiny_shape: its heads and 2,048-token batches).
    from omegaconf import OmegaConf

    common = dict(o.split("=", 1) for o in OmegaConf.load(P.ROOT / "conf/study/deep_recent.yaml").common)
    for key in ("layers", "ffn"):
        assert common[f"model.encoder_{key}"] == common[f"model.decoder_{key}"], f"deep_recent: encoder_{key}"
    return replace(P.tiny_shape(), d=int(common["model.d_model"]), layers=int(common["model.encoder_layers"]),
                   ffn=int(common["model.encoder_ffn"]))


SHAPES = {"reference": P.Shape, "small": lambda: P.small(P.Shape()), "deep_recent": deep_recent_shape}


def build(shape: P.Shape, residual: dict, batch: dict, device) -> tuple[PreNorm, torch.optim.Optimizer]:
    torch.manual_seed(0)
    peer = PreNorm(shape, residual)
    peer.model.to(device)
    opt = P.adam(peer.model.parameters(), device)
    P.timed_step(peer, opt, batch, device)  # warm-up: Adam's state exists before the measured steps
    return peer, opt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--shape", choices=sorted(SHAPES), default="reference")
    which.add_argument("--small", action="store_true", help="the same as --shape small")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per model, taken in turns (median)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps: {args.steps}; must be at least 1")
    shape = SHAPES["small" if args.small else args.shape]()
    device = torch.device(args.device)
    (batch,) = P.synthetic_batches(shape, 1, device)
    print(f"torch {torch.__version__}, {device}, threads {torch.get_num_threads()}; d {shape.d}, "
          f"{shape.layers}+{shape.layers} layers, batch {tuple(batch['src'].shape)}")
    peaks, params = {}, {}
    for name, residual in VARIANTS.items():  # one model at a time: a CUDA peak counts every live model
        peer, opt = build(shape, residual, batch, device)
        peaks[name] = P.peak_step_memory(peer, opt, batch, device) / 2 ** 20
        params[name] = peer.model.num_parameters()
        del peer, opt
    models = {name: build(shape, residual, batch, device) for name, residual in VARIANTS.items()}
    times = {name: [] for name in models}
    for _ in range(args.steps):  # in turns: a busy moment slows every model alike
        for name, (peer, opt) in models.items():
            times[name].append(P.timed_step(peer, opt, batch, device))
    print(f"{'residual':<20} {'parameters':>12} {'peak MiB':>9} {'x add':>6} {'step s':>8} {'x add':>6}")
    base_s = P.quantiles(times["add"])[1]
    for name in models:
        step = P.quantiles(times[name])[1]
        print(f"{name:<20} {params[name]:>12,} {peaks[name]:>9.0f} {peaks[name] / peaks['add']:>6.2f} "
              f"{step:>8.3f} {step / base_s:>6.2f}")


if __name__ == "__main__":
    main()
