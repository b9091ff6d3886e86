"""One update's gradient, between the last backward and optimizer.step: its normalisation by the
update's target tokens under accumulation, and its norm, measured once and read by every rule that
decides on it (drop a non-finite update, skip a spike, count and apply clipping). Seq2SeqModule's
on_before_optimizer_step and configure_gradient_clipping call these (lit_module.py).

The loss is fairseq's: summed over target tokens and divided by the update's token count (all ranks,
all accumulated micro-batches), so k ranks, k micro-batches and one process on the union batch give
the same gradient. The accumulated gradient is divided once, before clipping and the step (fairseq's
multiply_grads).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from normlab.private_api import pending_loss_scale, unscales_in_step


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def normalize_accumulated_(params, tokens: float, k: int, device) -> None:
    """grad = sum over the update's micro-batches and ranks of the summed loss's gradient / the update's
    target tokens. Lightning has divided each micro-batch's loss by K and DDP averaged over W ranks, so
    the gradients are multiplied by K * W / tokens (a device tensor under DDP: no host sync)."""
    tokens = float(max(tokens, 0))
    world = dist.get_world_size() if distributed() else 1
    if distributed():
        t = torch.tensor(tokens, device=device)
        dist.all_reduce(t)
        scale = (k * world) / t.clamp(min=1.0)
    else:
        scale = (k * world) / max(tokens, 1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)


def drop_(params: list) -> None:
    """No update from this gradient: torch's optimizers step only the parameters that have one, so
    the weights, their moments and their step counts stay as they were (the schedule still advances)."""
    for p in params:
        p.grad = None


# A skip under fp16's GradScaler: Lightning still calls scaler.step and scaler.update after this
# (MixedPrecision.optimizer_step), and update() needs the inf check of this step. Where Lightning has
# unscaled the gradients (every optimizer but fused Adam) the check was recorded then, and step() with
# no gradient steps nothing. Fused Adam unscales in its own step, so the check would be made in step()
# over the gradients left: none, and update() raised "No inf checks were recorded prior to update".
# Unscaling it here first records the check (a finite one: the skipped update counts towards the
# scale's growth interval as a good step does, as with the other optimizers), and step() then hands fused Adam no scale and no gradient. A run does not
# reach this today: with skip_spikes under mixed precision adam_on_gpu picks the unfused Adam (and a
# resume= of a fused checkpoint restores the group's `fused` flag but not the optimizer's
# _step_supports_amp_scaling, so Lightning unscales it as any other); the gate no longer relies on that.


def gate_update(optimizer, precision_plugin, stats, spikes, step: int, clip_val, clip_algorithm) -> bool:
    """The update's gradient norm, once (stats.grad_norm, the one host sync per update: skipping decides
    before the step), true under fp16 (divided by the loss scale where the optimizer unscales in its own
    step: fused Adam; Lightning has unscaled the others' already), and every rule on it: a non-finite
    gradient is dropped (fp16's scaler skips an overflow itself), a spike is skipped (optim.skip_spikes:
    `spikes`, a SpikeGate or None), the clip rate is counted, and clipping by norm scales by it (torch's
    clip_grad_norm_ without measuring again). True when Lightning's own configure_gradient_clipping is
    to run instead: no gradient, clipping by value or none, or a fused optimizer's scaled gradients."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    norm = torch.nn.utils.get_total_norm(grads)
    scale = pending_loss_scale(precision_plugin, optimizer)
    if scale is not None:  # fp16 with fused Adam: still scaled (Lightning did not unscale); the true norm
        norm = norm / scale  # on the device: still the one host sync below
    value = stats.grad_norm = float(norm)
    scaler = getattr(precision_plugin, "scaler", None)
    fused_scaling = scaler is not None and unscales_in_step(optimizer)
    if not math.isfinite(value) and scaler is None:
        drop_(params)
        return False
    if spikes is not None and math.isfinite(value) and spikes.skip(value, step):
        if fused_scaling:  # the scaler's inf check of this step, before its gradients go (above)
            scaler.unscale_(optimizer)
        drop_(params)
        return False
    if clip_val and math.isfinite(value):  # the share of updates clipping shortens
        stats.clipped += float(value > clip_val)
        stats.clip_steps += 1
    if clip_val and clip_algorithm in (None, "norm") and not fused_scaling:
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, norm)
        return False
    return True  # by value, none, or Lightning's refusal of a fused optimizer's scaled gradients
