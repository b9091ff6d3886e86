"""Every use of another library's private API, in one place (the pinned versions: constraints.txt).

Each is something the public API does not offer; tests/test_private_api.py calls each one on the
pinned libraries, so an upgrade that renames or drops one fails there, by name, rather than as a
silent change of behaviour inside a run. (W&B's run-file format has its own reader, wandb_files.py,
tested in tests/test_loggers.py.)
"""
from __future__ import annotations

import contextlib
import sys

# imported once here, not in global_module_hooks: every residual block's dropout asks it per forward
from torch.nn.modules import module as _torch_module


def should_accumulate(trainer) -> bool:
    """Lightning: this micro-batch does not end an update (a checkpoint saved now would split one)."""
    return bool(trainer.fit_loop._should_accumulate())


def validation_due(trainer) -> bool:
    """Lightning: the fit loop validates after this batch (a checkpoint waits for the validation,
    so the best checkpoint and the full state agree)."""
    if not trainer.enable_validation or trainer.limit_val_batches == 0:
        return False
    return bool(trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def unscales_in_step(optimizer) -> bool:
    """torch: the optimizer unscales fp16 gradients inside its own step (fused Adam), so before it they
    are still scaled; GradScaler and Lightning's MixedPrecision read the same flag."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def pending_loss_scale(precision_plugin, optimizer):
    """torch / Lightning: the loss scale fp16's GradScaler has left on the gradients before `optimizer`'s
    step, as a device tensor (GradScaler._get_scale_async: no host sync), or None when they carry none:
    no scaler, no scaled backward yet, or Lightning unscaled them before on_before_optimizer_step. It does
    unless the optimizer unscales inside its own step (fused Adam, unscales_in_step): then every norm
    measured before the step is the true one times the scale."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or not unscales_in_step(optimizer):
        return None
    return scaler._get_scale_async()


def logs_this_step(module) -> bool:
    """Lightning: the logger connector writes this step's metrics (values are read back only then).
    False outside Trainer.fit."""
    connector = getattr(module._trainer, "_logger_connector", None)  # no trainer: module._trainer is None
    return connector is not None and bool(getattr(connector, "should_update_logs", True))


def drop_wandb_init_key(logger, key: str) -> None:
    """Lightning's WandbLogger: a keyword it passes to wandb.init (anonymous=None, which wandb warns
    about on every run)."""
    logger._wandb_init.pop(key, None)


def global_module_hooks() -> bool:
    """torch: forward hooks registered for every module (a profiler measuring each module's output)."""
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


def module_hooks(module) -> bool:
    """torch: forward (pre-)hooks registered on this module (nn.Module has no public query; its own
    __call__ reads the same dicts to decide whether to run them)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def foreach_norms(tensors: list) -> list:
    """torch: the 2-norm of each tensor, in one fused kernel per device and dtype (what clip_grad_norm_
    and get_total_norm use inside); the public per-tensor norm is one kernel launch per tensor, which
    the observatory's per-layer gradient norms would pay on every update."""
    import torch

    return list(torch._foreach_norm(tensors))


def numpy_mmap(array):
    """numpy: the mmap.mmap under an np.memmap (None for any other array), for madvise; numpy keeps
    it in the private `_mmap` (public since no version)."""
    return getattr(array, "_mmap", None)


def tensor_version(t) -> int:
    """torch: a tensor's version counter, which every in-place change bumps (attention's key-mask
    memo is stale once its source tensor changed; torch has no public accessor)."""
    return t._version


def reset_hydra() -> None:
    """Hydra: forget the process's global Hydra state (its config search path and loaded config),
    so the compose API can initialise again in the same process (a study composes one config per
    run). Hydra's docs use this for notebooks; it lives in hydra.core, not hydra's public API."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()


@contextlib.contextmanager
def hydra_app_argv(argv: list[str]):
    """Hydra: a `@hydra.main` app reads its overrides from sys.argv only (its argv-taking runner is
    private), so commands.train.main(argv) runs it with sys.argv = [script, *argv]; afterwards the
    process's argv is back and Hydra's global HydraConfig is empty, so an in-process caller (tests,
    a study) does not see this run's Hydra config."""
    from hydra.core.hydra_config import HydraConfig

    saved = sys.argv
    sys.argv = [saved[0] if saved else "train.py", *argv]
    try:
        yield
    finally:
        HydraConfig.instance().cfg = None
        sys.argv = saved


def hydra_job_config():
    """Hydra: the job's whole Hydra config as `{hydra: ...}`, the node Hydra's run_job saves as
    .hydra/hydra.yaml (HydraConfig.get() gives only its `hydra` child, unwrapped)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.instance().cfg


def saved_last(callback, path: str) -> None:
    """Lightning's ModelCheckpoint: the file this callback saved last in this process, which its
    state_dict does not carry (lightning 2.6). Its on_train_end writes last.ckpt where there is none
    (save_last): a continued run that saved nothing yet wrote a last.ckpt at its last step that the
    uninterrupted run, which saved one at a validation, does not write."""
    callback._last_checkpoint_saved = path


# Lightning's private methods normlab's subclasses override, by class: tests/test_private_api.py
# checks that each still exists and is still what the public hook calls.
#   ModelCheckpoint._monitor_candidates(trainer) -> dict: the metrics every save ranks by
#   (callbacks/checkpoints.py: BestCheckpoint ranks a loss-only validation last).
OVERRIDDEN = {"lightning.pytorch.callbacks.ModelCheckpoint": ("_monitor_candidates",)}
