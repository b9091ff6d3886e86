"""A run's budget in optimizer steps, whatever devices, accumulation or wall clock do.

- Tokens per update = data.max_tokens x devices x nodes x accumulate_grad_batches (the padded
  token budget of one optimizer step; length bucketing keeps real target tokens near 90% of it).
  With `optim.tokens_per_update` set (the `_paper` presets: Vaswani et al. 2017 train on ~25k
  target tokens per update), accumulation is derived from it and the devices, so 1, 2, 4 or 8
  GPUs train with the same batch; the run prints the product either way.
- trainer.val_check_interval counts optimizer steps: Lightning counts batches, so it is multiplied
  by the accumulation here (otherwise validation would run `accumulate` times as often).
- trainer.max_time caps one invocation; a run it stops early says so (stopped_by: max_time).
"""
from __future__ import annotations

import logging
from typing import Any

from normlab.config import ConfigError

log = logging.getLogger("normlab")


def world_size(trainer_cfg: Any) -> int:
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, int) and devices > 0:
        n = devices
    elif isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        n = len(devices)
    else:  # "auto" / -1: every visible accelerator
        import torch

        n = torch.cuda.device_count() if trainer_cfg.get("accelerator") in ("gpu", "cuda", "auto") else 1
    return max(n, 1) * int(trainer_cfg.get("num_nodes") or 1)


def _accumulation(t: Any, max_tokens: int, target: int | None) -> tuple[int, int, int]:
    """(devices x nodes, accumulation, padded tokens per update)."""
    world, max_tokens = world_size(t), int(max_tokens)
    accumulate = int(t.get("accumulate_grad_batches") or 1)
    if target:
        if not isinstance(target, int) or target < 1:
            raise ConfigError(f"optim.tokens_per_update={target!r} must be a positive integer (or null)")
        accumulate = max(1, round(target / (max_tokens * world)))
    return world, accumulate, max_tokens * world * accumulate


def trainer_overrides(t: Any, max_tokens: int, target: int | None) -> dict[str, Any]:
    """accumulate_grad_batches (from `target`, optim.tokens_per_update) and val_check_interval in
    batches, for the Trainer settings `t` (the config's `trainer`) and data.max_tokens."""
    _, accumulate, _ = _accumulation(t, max_tokens, target)
    out: dict[str, Any] = {"accumulate_grad_batches": accumulate}
    interval = t.get("val_check_interval")
    if isinstance(interval, int) and not isinstance(interval, bool):
        if interval < 1:
            raise ConfigError(f"trainer.val_check_interval={interval!r} must be >= 1 optimizer steps (or a fraction of an epoch)")
        out["val_check_interval"] = interval * accumulate
    return out


def budget_notes(t: Any, max_tokens: int, target: int | None,
                 max_positions: int = 1) -> tuple[tuple[int, str], ...]:
    """The (log level, line) a run prints about its tokens per update once it starts training (not
    when it is found finished, nor before its folder is held). `max_positions`: the smallest
    data.max_tokens a run accepts (a batch holds the longest pair: run_config.py)."""
    world, accumulate, per_update = _accumulation(t, max_tokens, target)
    notes = [(logging.INFO, f"tokens per update: data.max_tokens {int(max_tokens)} x {world} device(s) x accumulation "
                            f"{accumulate} = {per_update}" + (f" (optim.tokens_per_update={target})" if target else ""))]
    if target and not 0.8 <= per_update / target <= 1.25:
        notes.append((logging.WARNING, f"tokens per update {per_update} is far from optim.tokens_per_update={target}: "
                                       + _advice(target, world, accumulate, max_positions)))
    return tuple(notes)


def _advice(target: int, world: int, accumulate: int, max_positions: int) -> str:
    """A data.max_tokens that reaches `target`, keeping as much of the derived accumulation as a
    batch of at least `max_positions` tokens allows (the less memory, the more accumulation); or,
    when even one batch per device is more than the target, what would."""
    for a in range(accumulate, 0, -1):
        if target // (world * a) >= max_positions:
            return f"set data.max_tokens to about {target // (world * a)}"
    smallest = max_positions * world
    return (f"the smallest update here is data.max_tokens {max_positions} (model.max_positions, the least a batch "
            f"holds) x {world} device(s) = {smallest} tokens: set optim.tokens_per_update to at least {smallest}, "
            "or train on fewer devices")


def stopped_by_time(trainer) -> bool:
    from lightning.pytorch.callbacks import Timer

    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    planned = trainer.max_steps
    return timer is not None and (timer.time_remaining() or 0.0) <= 0 and (planned < 0 or trainer.global_step < planned)
