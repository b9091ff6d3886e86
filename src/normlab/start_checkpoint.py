"""resume= / finetune='s start checkpoint: read and checked against the run before its first log line
(start_point), its weights loaded for fine-tuning (load_finetune_weights) or checked against the model
the command line builds for resume (check_weights_fit). train.py builds the run from what it finds.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from normlab.config import ConfigError
from normlab.run_folder import Continuation, readable
from normlab.run_spec import RunSpec
from normlab.settings import OptimSpec


@dataclass(frozen=True)
class Start:
    """resume= / finetune='s checkpoint: its file and contents (None: the run starts afresh)."""
    ckpt: Path | None = None
    state: dict | None = None

    @property
    def step(self) -> int:
        return int((self.state or {}).get("global_step") or 0)


def start_point(spec: RunSpec, cont: Continuation) -> Start:
    """The start checkpoint, checked. Every check comes before the run's first log line, so that a
    refusal is the one line it says (errors.py): the start checkpoint, then its weights against the
    model (before the data where the checkpoint holds its tokenizer), then the corpus, and only then
    what the run will do."""
    if not spec.start:
        return Start()
    ckpt = spec.start_path  # the file `start` names, found once (run_identity.identify)
    start = Start(ckpt, readable(ckpt))
    if start.state is None:
        raise ConfigError(f"{ckpt}: not a readable checkpoint")
    if "tokenizer_proto" not in start.state:  # as translate / evaluate refuse it
        raise ConfigError(f"{'finetune' if spec.finetune else 'resume'}={spec.start}",
                          "not a normlab checkpoint (no tokenizer_proto): the token ids its weights were trained "
                          "on cannot be matched to this corpus's; start from a checkpoint a normlab run wrote "
                          "(<run>/checkpoints/*.ckpt)")
    if spec.resume and cont.checkpoint is None:
        _same_optimizer(spec, start.state)
    if spec.resume and cont.checkpoint is None and 0 < spec.max_steps <= start.step:
        raise ConfigError(f"resume={spec.start}", f"the checkpoint is at step {start.step}: trainer.max_steps="
                                                  f"{spec.max_steps} leaves nothing to train (set it above "
                                                  f"{start.step}, or use finetune= to start the step count afresh)")
    return start


def _same_optimizer(spec: RunSpec, state: dict) -> None:
    """resume= restores the optimizer's state, its parameter groups and each group's weight decay with
    it (torch's load_state_dict): another optim.optimizer or optim.no_decay cannot resume it (a checkpoint
    from before these keys trained with Adam and the default groups)."""
    saved = OptimSpec.of({k: v for k, v in ((state.get("hyper_parameters") or {}).get("optim") or {}).items()
                          if k in ("optimizer", "no_decay")})
    def plain(v):  # no_decay: a list (validated into one order), whatever sequence held it
        return list(v) if isinstance(v, (list, tuple)) else v

    for key in ("optimizer", "no_decay"):
        was, now = plain(getattr(saved, key)), plain(getattr(spec.optim, key))
        if was != now:
            raise ConfigError(f"optim.{key}", f"{now!r}: resume={spec.start} trained with {was!r}, whose optimizer "
                                              "state resume restores (use finetune= to start the optimizer afresh, "
                                              "or leave the key as it was)")


def load_finetune_weights(model, ckpt: dict, path) -> None:
    """The checkpoint's weights; LayerDrop's draw counter starts afresh with the other counters
    (and a LayerDrop rate set to 0 for fine-tuning has none)."""
    fresh = "draw_state"
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items()
             if k.startswith("model.") and not k.endswith(fresh)}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes differ: a model setting typed on the command line
        raise ConfigError(f"finetune={path}: the weights do not fit the model: {str(e).splitlines()[-1].strip()}") from None
    missing = [k for k in missing if not k.endswith(fresh)]
    if missing or unexpected:
        raise ConfigError(f"finetune={path}: the weights do not fit the model (missing: {missing[:3]}, "
                          f"unexpected: {unexpected[:3]})")


def check_weights_fit(module, ckpt: dict, path) -> None:
    """resume=: Lightning restores the checkpoint strictly; a model setting typed on the command line
    that changes a shape is one ConfigError here instead of a traceback from inside fit. Exactly what
    a strict load accepts fits: where the keys or shapes differ, the modules' load pre-hooks may
    still reconcile them, e.g. a pruned HybridNorm* stack whose rebuilt first layer has an input norm
    the saved one lacks (schemes/recent.py, _drop_unsaved_input_norm), so the strict load decides.
    It changes `module` as the hooks do before Lightning's own load, which is in time: Trainer._run
    (lightning 2.6) restores the model (_restore_modules_and_callbacks) before strategy.setup builds
    the optimizers, for every strategy whose restore_checkpoint_after_setup is False (ours: single
    device and DDP; FSDP and DeepSpeed restore after setup)."""
    theirs = ckpt["state_dict"]
    if _first_difference(module.state_dict(), theirs) is None:
        return
    try:
        module.load_state_dict(theirs, strict=True)
    except RuntimeError as e:  # missing, unexpected or mis-shaped weights that no hook reconciles
        # named after the hooks ran (they run before the load fails): a difference they leave
        first = _first_difference(module.state_dict(), theirs) or str(e).splitlines()[-1].strip()
        raise ConfigError(f"resume={path}", f"the checkpoint's weights do not fit the model the command line builds "
                          f"(first difference: {first}); drop the model overrides, or use finetune=") from None


def _first_difference(own: dict, theirs: dict) -> str | None:
    """The first key only one of two state dicts has, else the first whose shapes differ, or None."""
    bad = sorted(set(own) ^ set(theirs)) or [k for k in own if own[k].shape != theirs[k].shape]
    return bad[0] if bad else None
