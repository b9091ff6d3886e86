"""Memory and parameters of hyper-connections (model.residual, issue 20): one training step each of
pre-LN with the plain residual (add) and with n residual streams (hyper static / dynamic, mHC), at
the benchmarks' reference config (peers.Shape: 6+6 layers, d 256, FFN 1024, 8k tied vocabulary,
batches of 128 x 32 tokens), pre-norm (the placement hyper-connections take), no dropout.

Prints the parameter count and the peak bytes live in one step (parameters, gradients, Adam
state, activations; CPU: tensor storages, peers.LiveBytes; CUDA: the allocator's peak) and one
step's wall time (one step: indicative only, the machine may be busy).

    .venv/bin/python benchmarks/hyper_memory.py              # the reference config (~1 min on 2 cores)
    .venv/bin/python benchmarks/hyper_memory.py --small      # check the script (seconds)
"""
from __future__ import annotations

import argparse
import sys
import time
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a small model, to check the script")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    shape = P.small(P.Shape()) if args.small else P.Shape()
    device = torch.device(args.device)
    (batch,) = P.synthetic_batches(shape, 1, device)
    print(f"torch {torch.__version__}, {device}, threads {torch.get_num_threads()}; d {shape.d}, "
          f"{shape.layers}+{shape.layers} layers, batch {tuple(batch['src'].shape)}")
    print(f"{'residual':<20} {'parameters':>12} {'peak MiB':>9} {'x add':>6} {'step s':>7}")
    base = None
    for name, residual in VARIANTS.items():
        torch.manual_seed(0)
        peer = PreNorm(shape, residual)
        peer.model.to(device)
        opt = P.adam(peer.model.parameters(), device)
        P.timed_step(peer, opt, batch, device)  # warm-up: Adam's state exists before the measured step
        peak = P.peak_step_memory(peer, opt, batch, device) / 2 ** 20
        seconds = P.timed_step(peer, opt, batch, device)
        base = base or peak
        print(f"{name:<20} {peer.model.num_parameters():>12,} {peak:>9.0f} {peak / base:>6.2f} {seconds:>7.2f}")


if __name__ == "__main__":
    main()
