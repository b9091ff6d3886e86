"""Batched greedy decoding over the model's incremental (KV-cached) decoder.

Each step feeds only the newest token; the prefix's keys/values come from the cache, and rows that
have finished are dropped from the batch (`cache.reorder`), so a validation pass over many
sentences costs about one decoder step per produced token.
"""
from __future__ import annotations

import torch

from normlab.decoding.beam import max_lengths


@torch.no_grad()
def greedy_decode(model, src: torch.Tensor, max_len_a: float = 1.0, max_len_b: int = 50,
                  min_len: int = 0) -> list[list[int]]:
    # Returns, per source row, the token ids produced before EOS (no BOS/EOS/PAD).
    # Length limit per sentence: max_len_a · |src| + max_len_b tokens (|src| counts non-pad ids;
    # Vaswani et al. 2017 decode up to |src| + 50), capped at max_positions - 1 as in beam search
    # (which needs one more position to score the EOS), so greedy == beam search with beam 1.
    cfg = model.cfg
    was_training = model.training
    model.eval()
    try:
        memory, src_pad_mask = model.encode(src)  # (B, S, D), (B, S)
        max_len = max_lengths(src_pad_mask, max_len_a, max_len_b, cfg.max_positions)  # (B,)
        B, steps = src.size(0), int(max_len.max())
        out = torch.full((B, steps), cfg.pad_id, dtype=torch.long, device=src.device)
        active = torch.arange(B, device=src.device)  # original rows still decoding
        prev = torch.full((B, 1), cfg.bos_id, dtype=torch.long, device=src.device)
        cache = model.new_cache()
        for t in range(steps):
            logits = model.decode(prev, memory, src_pad_mask, cache)[:, -1]  # (b, V)
            logits[:, [cfg.pad_id, cfg.bos_id]] = float("-inf")
            if t < min_len:
                logits[:, cfg.eos_id] = float("-inf")
            token = logits.argmax(dim=-1)  # (b,)
            out[active, t] = token
            running = token.ne(cfg.eos_id) & (max_len[active] > t + 1)
            if not running.any():
                break
            if not running.all():
                keep = running.nonzero().squeeze(1)
                cache.reorder(keep, sources=keep)
                memory, src_pad_mask = memory[keep], src_pad_mask[keep]
                active, token = active[keep], token[keep]
            prev = token[:, None]  # (b, 1)
    finally:
        model.train(was_training)
    return [_strip(row, cfg.eos_id, cfg.pad_id) for row in out.tolist()]


def _strip(row: list[int], eos_id: int, pad_id: int) -> list[int]:
    if eos_id in row:
        row = row[: row.index(eos_id)]
    return [tok for tok in row if tok != pad_id]
