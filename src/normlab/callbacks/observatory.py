"""The stability observatory (issue 38; off by default: `callbacks.observatory.enabled=true`).

At each validation (not the sanity check), on a fixed batch, the first of the validation set, in eval
mode and the run's validation precision, per residual block (enc.<i>.self_attn, dec.<i>.cross_attn,
...) it measures, with the statistics of normlab/observatory.py:
- rms, max_abs, kurtosis        the residual stream after the block (real tokens only; kurtosis: the
                                excess kurtosis over the features, the outlier-feature measure of OSP);
- out_rms, out_max_abs          the sub-layer's output F(x), before dropout and the residual;
- entropy_h<i>, sink_h<i>       per head of an attention sub-layer: attention entropy (nats) and the
                                share of attention on the first position, over real queries;
- max_logit                     the attention's largest pre-softmax logit, scaled as SDPA scales it;
- grad_norm, grad_spike         the block's gradient norm at the last update before the validation, and
                                the largest ratio of its norm to the median of its last `window` norms
                                over the updates since the previous validation.
The attention probabilities are computed explicitly from q and k (MultiheadAttention.attention_map)
by forward hooks registered for this one forward and removed after it; training's SDPA is untouched.

Logged to every logger as `obs_<statistic>/<block>` (per head: `obs_entropy/<block>.h<i>`): W&B makes a
panel section of each name's first segment, so each statistic is one section with a chart per layer,
each chart comparing the runs shown. results.json `observatory` holds the last validation's values,
{"step": N, "layers": {block: {statistic: value}}}. Nothing of it changes what a run trains (eval
mode, no random draw; identity.NOT_IDENTITY). When off the factory builds nothing: no hook, no work.
Cost when on: per update, one fused norm over the gradients (no host sync); per validation, one forward.
"""
from __future__ import annotations

import math

import lightning as L
import torch
from torch import nn

from normlab.config import check_bool, check_number
from normlab.model.attention import MultiheadAttention
from normlab.observatory import GradWindow, attention_stats, max_abs, rms, stream_stats
from normlab.private_api import foreach_norms


def observatory(enabled: bool = False, window: int = 100) -> "Observatory | None":
    check_bool("callbacks.observatory.enabled", enabled)
    check_number("callbacks.observatory.window", window, "an integer >= 1 (optimizer steps)", lambda v: v >= 1,
                 integer=True)
    return Observatory(window) if enabled else None  # None: not in the run's callbacks at all


@torch.no_grad()
def observe(model: nn.Module, src: torch.Tensor, tgt_in: torch.Tensor) -> dict[str, dict[str, float]]:
    """{block: {statistic: value}} of one forward of `model` (in its current mode) on (src, tgt_in)."""
    real = {"enc": src.ne(model.cfg.pad_id), "dec": tgt_in.ne(model.cfg.pad_id)}  # (B, S), (B, T)
    out: dict[str, dict[str, float]] = {}
    handles = []
    for name, block in model.residual_blocks():
        stats, mask = out.setdefault(name, {}), real[name.split(".", 1)[0]]
        handles.append(block.register_forward_hook(_stream(block, mask, stats)))
        handles.append(block.sublayer.register_forward_hook(_output(mask, stats)))
        if isinstance(block.sublayer, MultiheadAttention):
            handles.append(block.sublayer.register_forward_pre_hook(_attention(mask, stats), with_kwargs=True))
    try:
        model.forward(src, tgt_in, project=False)  # eager: model.compile=true compiles __call__, and hooks
        # that change at every validation would recompile it each time
    finally:
        for h in handles:
            h.remove()
    return out


def _stream(block, mask, stats):
    def hook(module, args, out):
        stats.update(stream_stats(block.stream(out), mask))  # (B, T, D): the stream the next block reads
    return hook


def _output(mask, stats):
    def hook(module, args, out):
        rows = out[mask]  # (N, D): the real tokens' outputs, selected once
        stats.update(out_rms=rms(rows), out_max_abs=max_abs(rows))
    return hook


def _attention(mask, stats):
    def hook(module, args, kwargs):
        s, p = module.attention_map(*args, **kwargs)  # (B, H, T, S) each
        stats.update(attention_stats(s, p, mask))
    return hook


class BlockGradNorms:
    """Each residual block's gradient norm (L,) and the norm over all `params`' gradients, on the device,
    without a host sync: one fused norm per gradient, summed per block by an index built once (again
    only when the parameters with a gradient change)."""

    def __init__(self):
        self._key: tuple | None = None
        self._index = self._picked = None
        self._blocks = 0

    def __call__(self, model: nn.Module, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        grads = [p for p in params if p.grad is not None]
        if not grads:
            return None
        norms = torch.stack(foreach_norms([p.grad for p in grads])).float()  # (P,)
        key = tuple(id(p) for p in grads)
        if key != self._key:
            where = {id(p): i for i, p in enumerate(grads)}
            blocks = [[where[id(p)] for p in block.parameters() if id(p) in where]
                      for _, block in model.residual_blocks()]
            self._index = torch.tensor([b for b, ids in enumerate(blocks) for _ in ids], dtype=torch.long,
                                       device=norms.device)
            self._picked = torch.tensor([i for ids in blocks for i in ids], dtype=torch.long, device=norms.device)
            self._key, self._blocks = key, len(blocks)
        squares = norms.new_zeros(self._blocks).index_add_(0, self._index, norms[self._picked].pow(2))
        return squares.sqrt(), norms.pow(2).sum().sqrt()


class Observatory(L.Callback):
    def __init__(self, window: int = 100):
        self.grads = GradWindow(window)
        self.last: dict | None = None  # {"step": N, "layers": {...}}: the last validation's
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._norms = BlockGradNorms()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.is_global_zero:  # rank 0 reports; its gradients are every rank's (DDP averaged them)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self._pending = self._norms(pl_module.model, params)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._pending is None:
            return
        (blocks, total), self._pending = self._pending, None
        norm = pl_module.stats.grad_norm  # the update's, measured by the module after its normalisation
        if norm is not None:  # under accumulation the module rescales every gradient by one factor after
            # this callback's hook: the ratio puts it back; so it removes fp16's loss scale, which the gradients
            # still carry here with fused Adam (the module's norm is divided by it: private_api.pending_loss_scale)
            self.grads.add(blocks * (norm / total))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx or dataloader_idx or trainer.sanity_checking or not trainer.is_global_zero:
            return
        with trainer.precision_plugin.val_step_context():  # as Lightning runs validation_step
            layers = observe(pl_module.model, batch["src"], batch["tgt_in"])
        report = self.grads.report()
        if report is not None:
            for name, norm, spike in zip(layers, *report):
                layers[name].update(grad_norm=norm, grad_spike=spike)
        self.last = {"step": trainer.global_step, "layers": layers}
        for logger in trainer.loggers:
            logger.log_metrics(metric_names(layers), step=trainer.global_step)

    def summary(self) -> dict | None:
        """results.json `observatory`: the last validation's values (nan as null), None before one."""
        if self.last is None:
            return None
        finite = lambda v: v if math.isfinite(v) else None  # noqa: E731
        return {"step": self.last["step"],
                "layers": {n: {k: finite(v) for k, v in s.items()} for n, s in self.last["layers"].items()}}

    def state_dict(self) -> dict:
        return {"last": self.last, "grads": self.grads.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.last = state.get("last")
        self.grads.load_state_dict(state.get("grads", {}))


def metric_names(layers: dict[str, dict[str, float]]) -> dict[str, float]:
    """{block: {statistic: v}} -> {`obs_<statistic>/<block>`: v}; a head's `entropy_h0` ->
    `obs_entropy/<block>.h0`, so one section per statistic holds every layer and head."""
    out = {}
    for name, stats in layers.items():
        for key, value in stats.items():
            stat, _, head = key.rpartition("_h") if key.startswith(("entropy_h", "sink_h")) else (key, "", "")
            out[f"obs_{stat}/{name}" + (f".h{head}" if head else "")] = value
    return out
