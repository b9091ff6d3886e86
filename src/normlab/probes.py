"""Admin's output-change probe (Liu et al. 2020): how much does the model output move under a
small parameter update? Post-norm's change grows with depth (O(N)), pre-norm's and Admin's as
O(log N).

W* = W − δ·sign(ε), ε ~ N(0, 1) per entry (papers.md: "perturb weights by −1e-4·sign(N(0,1))"),
for every parameter; the change is ‖F(x; W) − F(x; W*)‖₂ over the whole batch at the encoder
output and at the decoder output (final hidden states, before the tied output projection). Most
schemes end each stack in a norm, so their outputs have comparable scale; ReZero (no norm), DyT
(bounded, not normalised) and ResiDual (two streams added) do not: compare those by the change
relative to ‖F(x; W)‖ (normlab-study output_change reports both). Evaluated in eval
mode (no dropout); the parameters are restored exactly (copied back, not re-added).
Pure torch: used by the diagnostics callback and by the output_change study (normlab.study.probe).
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def output_change(model: nn.Module, src: torch.Tensor, tgt_in: torch.Tensor, delta: float = 1e-4,
                  seed: int = 0) -> dict[str, float]:
    was_training = model.training
    model.eval()
    try:
        def outputs():
            memory, pad = model.encode(src)
            return memory, model.decoder(tgt_in, memory, pad)  # (B, S, D), (B, T, D)

        enc0, dec0 = outputs()
        g = torch.Generator(device=src.device).manual_seed(seed)
        saved = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.sub_(delta * torch.sign(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype)))
        enc1, dec1 = outputs()
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    finally:
        model.train(was_training)
    # pad positions carry no data: measure over real tokens only
    smask, tmask = src.ne(model.cfg.pad_id), tgt_in.ne(model.cfg.pad_id)
    return {"encoder": (enc1 - enc0)[smask].norm().item(), "decoder": (dec1 - dec0)[tmask].norm().item()}
