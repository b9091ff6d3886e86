"""Per-layer diagnostics that explain the normalization studies (off by default).

Turn on with `callbacks.diagnostics.every_n_steps=k` (0 = off, the default). Every k optimizer
steps (global steps 0, k, 2k, ...) it writes to every logger, with names that group by sub-layer
(`diag/<stack>.<layer>.<sublayer>/<quantity>`, stack enc|dec, sublayer self_attn|cross_attn|ffn):
- grad_norm   ‖∇‖ of the sub-layer's parameters (its F, its norm, its ω), before clipping;
- ratio       ‖F(x)‖/‖x‖ of the residual on this step's batch: F's output before dropout over the
              block's input, Frobenius norms over the batch (forward hooks that this callback
              registers for the step and removes after it; blocks LayerDrop skipped have none);
- g           ScaleNorm's scalar g of the block's norm (`g_out`: a sandwich block's second norm;
              also `diag/enc.final/g`, `diag/dec.final/g` for the stacks' final norms and
              `diag/output/g` for the FixNorm output layer when it owns its g);
- dyt_alpha   DyT's scalar α of the block's norm; derf_alpha, derf_shift: Derf's α and s;
- qk_g        QK-norm's (model.qk_norm=l2) scale g of an attention sub-layer;
- vr_lambda1, vr_lambda2   the value residual's λ₁, λ₂ of a self-attention sub-layer;
- a           ReZero's scalar;
- omega_mean / omega_min / omega_max   Admin's ω vector;
- `diag/output_change/encoder|decoder`: Admin's probe ‖F(x;W) − F(x;W*)‖, W* = W − δ·sign(N(0,1))
  (normlab.probes), on the first training batch of the run, parameters restored exactly.
Cost when on: one extra forward pair for the probe and a few norms every k steps; when off, one
integer test per batch and no hook on the model.
"""
from __future__ import annotations

import lightning as L
import torch
from torch import nn

from normlab.callbacks.observatory import BlockGradNorms
from normlab.config import check_number
from normlab.model.norms import Derf, DyT, ScaleNorm
from normlab.private_api import pending_loss_scale
from normlab.probes import output_change


@torch.no_grad()
def parameter_stats(model: nn.Module) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, block in model.residual_blocks():
        for key, norm in (("g", block.norm), ("g_out", block.norm_out)):
            if isinstance(norm, ScaleNorm):
                out[f"diag/{name}/{key}"] = norm.g.item()
        if isinstance(block.norm, DyT):
            out[f"diag/{name}/dyt_alpha"] = block.norm.alpha.item()
        if isinstance(block.norm, Derf):
            out.update({f"diag/{name}/derf_alpha": block.norm.alpha.item(), f"diag/{name}/derf_shift": block.norm.shift.item()})
        qk, vr = getattr(block.sublayer, "qk_norm", None), getattr(block.sublayer, "value_residual", None)
        if hasattr(qk, "g"):
            out[f"diag/{name}/qk_g"] = qk.g.item()
        if vr is not None:
            out.update({f"diag/{name}/vr_lambda{i + 1}": lam for i, lam in enumerate(vr.lambdas.tolist())})
        if block.scale is not None:
            out[f"diag/{name}/a"] = block.scale.item()
        if block.omega is not None:
            w = block.omega
            out.update({f"diag/{name}/omega_mean": w.mean().item(), f"diag/{name}/omega_min": w.min().item(),
                        f"diag/{name}/omega_max": w.max().item()})
    for key, stack in model.stacks().items():
        final = getattr(stack.final_norm, "norm", stack.final_norm)  # ResiDual's output holds its norm
        if isinstance(final, ScaleNorm):
            out[f"diag/{key}.final/g"] = final.g.item()
    if getattr(model.output_projection, "g", None) is not None:
        out["diag/output/g"] = model.output_projection.g.item()
    return out


@torch.no_grad()
def grad_norms(model: nn.Module, scale: torch.Tensor | None = None) -> dict[str, float]:
    """‖∇‖ of each block that has gradients, measured as the observatory measures them (one fused norm);
    divided by `scale`, the fp16 loss scale the gradients still carry (private_api.pending_loss_scale)."""
    measured = BlockGradNorms()(model, list(model.parameters()))
    if measured is None:
        return {}
    blocks = measured[0] if scale is None else measured[0] / scale
    return {f"diag/{name}/grad_norm": norm for (name, block), norm in zip(model.residual_blocks(), blocks.tolist())
            if any(p.grad is not None for p in block.parameters())}


class RatioHooks:
    """‖F(x)‖/‖x‖ of every residual block run while registered (forward hooks, removed by close)."""

    def __init__(self, model: nn.Module):
        self.inputs: dict[str, torch.Tensor] = {}
        self.ratios: dict[str, torch.Tensor] = {}
        self.handles = []
        for name, block in model.residual_blocks():
            self.handles.append(block.register_forward_pre_hook(self._input(name)))
            self.handles.append(block.sublayer.register_forward_hook(self._output(name)))

    def _input(self, name: str):
        def hook(module, args):
            self.inputs[name] = module.stream(args[0]).detach().norm()
        return hook

    def _output(self, name: str):
        def hook(module, args, out):
            self.ratios[name] = out.detach().norm() / self.inputs[name].clamp(min=1e-12)
        return hook

    def close(self) -> dict[str, float]:
        for h in self.handles:
            h.remove()
        return {name: r.item() for name, r in self.ratios.items()}


class Diagnostics(L.Callback):
    def __init__(self, every_n_steps: int = 0, probe_delta: float = 1e-4, probe_seed: int = 0):
        check_number("callbacks.diagnostics.every_n_steps", every_n_steps, "an integer >= 0 (0: off)", lambda v: v >= 0,
                     integer=True)
        self.every, self.delta, self.seed = every_n_steps, probe_delta, probe_seed
        self.probe_batch: dict | None = None
        self.metrics: dict[str, float] = {}
        self._hooks: RatioHooks | None = None
        self._step = 0

    def _due(self, trainer) -> bool:
        return self.every > 0 and trainer.global_step % self.every == 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step
        if not self._due(trainer):
            return
        if self.probe_batch is None:  # a fixed batch for the probe: the run's first
            self.probe_batch = {k: batch[k].detach().clone() for k in ("src", "tgt_in")}
        model = pl_module.model
        # parameters and probe before this step's update: the weights this batch's forward uses
        self.metrics = parameter_stats(model)
        change = output_change(model, self.probe_batch["src"], self.probe_batch["tgt_in"], self.delta, self.seed)
        self.metrics.update({f"diag/output_change/{k}": v for k, v in change.items()})
        self._hooks = RatioHooks(model)  # after the probe: only this batch's training forward counts

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._hooks is not None:
            self.metrics.update(grad_norms(pl_module.model, pending_loss_scale(trainer.precision_plugin, optimizer)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hooks is None:
            return
        ratios, self._hooks = self._hooks.close(), None
        self.metrics.update({f"diag/{name}/ratio": r for name, r in ratios.items()})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.metrics, step=self._step)
