"""Checkpoint averaging (Vaswani et al. 2017: the last 5 checkpoints for base, the last 20 for big).

As fairseq's scripts/average_checkpoints.py: the element-wise mean of every floating-point tensor
of the state dict, accumulated in float64 and cast back. Checkpoints must describe the same
network (same ModelConfig, same state-dict keys and shapes, same tokenizer); anything else is
refused with a message naming the first differences. The output is the last checkpoint with its
weights replaced and its optimizer state dropped, so `load_model`, the commands and
the final test pass (final_test.py) read it like any other checkpoint.

A scheme that constrains its weights has the constraint applied to the mean, as training applies it
after each optimizer step: nGPT's matrices have unit-norm rows (Loshchilov et al. 2025, arXiv
2410.01131, §2.1), and the mean of unit vectors is shorter than 1 unless they are equal, so the plain
average is a model off the sphere it was trained on (its logits are no longer cosines). The
renormalised mean is the average direction, what the average of a few nearby points on the sphere
approximates. The other schemes' averages are left as they are, bit for bit.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from normlab.checkpoint import atomic_write_bytes, load_checkpoint
from normlab.errors import UserError

# Periodic checkpoints written during training (callbacks.step_checkpoints.every_n_steps) are named
# step<N>.ckpt; best-step<N>.ckpt and last.ckpt are not part of the series.
STEP_CKPT = re.compile(r"^step(\d+)\.ckpt$")
TRAINING_STATE = ("optimizer_states", "lr_schedulers", "loops", "callbacks")
# Integer buffers that count training draws, not model values: LayerDrop's (seed, draw counter)
# advances every step, so step checkpoints differ in it; the average takes the last checkpoint's,
# as it takes the last's other training state. Any other integer tensor that differs is a mismatch.
COUNTERS = ("draw_state",)


class CheckpointMismatch(UserError, ValueError):
    """Checkpoints that do not describe the same network."""


def step_checkpoints(path: str | os.PathLike) -> list[Path]:
    """The step<N>.ckpt files of a run folder (or its checkpoints/ folder), by increasing step."""
    path = Path(path)
    ckdir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = [(int(m.group(1)), p) for p in ckdir.glob("step*.ckpt") if (m := STEP_CKPT.match(p.name))]
    return [p for _, p in sorted(found)]


def last_checkpoints(path: str | os.PathLike, n: int) -> list[Path]:
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    found = step_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no step<N>.ckpt checkpoints in {path} (training writes them when "
                                "callbacks.step_checkpoints.keep_last_n and every_n_steps are set)")
    return found[-n:]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _first(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


def check_compatible(ref: dict, other: dict, ref_name: str, other_name: str) -> None:
    a, b = _flat(ref.get("model_config", {})), _flat(other.get("model_config", {}))
    diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if diff:
        raise CheckpointMismatch(
            f"{other_name} has another architecture than {ref_name}: model_config differs in "
            + _first([f"{k}={b.get(k)!r} vs {a.get(k)!r}" for k in diff]))
    sa, sb = ref["state_dict"], other["state_dict"]
    missing, extra = sorted(sa.keys() - sb.keys()), sorted(sb.keys() - sa.keys())
    if missing or extra:
        raise CheckpointMismatch(f"{other_name} and {ref_name} have different parameters: "
                                 f"missing {_first(missing) or '-'}; extra {_first(extra) or '-'}")
    shapes = [f"{k} {tuple(sb[k].shape)} vs {tuple(sa[k].shape)}" for k in sa if sa[k].shape != sb[k].shape]
    if shapes:
        raise CheckpointMismatch(f"{other_name} and {ref_name} differ in shape: {_first(shapes)}")
    if ref.get("tokenizer_proto") != other.get("tokenizer_proto"):
        raise CheckpointMismatch(f"{other_name} and {ref_name} use different tokenizers")


def average_checkpoints(paths: list[str | os.PathLike]) -> dict:
    """One checkpoint dict whose weights are the mean of the given checkpoints' weights."""
    if not paths:
        raise ValueError("no checkpoints to average")
    paths = [Path(p) for p in paths]
    sums: dict[str, torch.Tensor] = {}
    first: dict | None = None
    last: dict = {}
    for path in paths:
        ckpt = load_checkpoint(path)
        if first is None:
            first = {k: v for k, v in ckpt.items() if k not in TRAINING_STATE}
            sums = {k: v.double().clone() if v.is_floating_point() else v for k, v in ckpt["state_dict"].items()}
        else:
            check_compatible(first, ckpt, str(paths[0]), str(path))
            for k, v in ckpt["state_dict"].items():
                if v.is_floating_point():
                    sums[k] += v.double()
                elif k.rsplit(".", 1)[-1] in COUNTERS and torch.equal(v[:1], sums[k][:1]):
                    sums[k] = v  # the last checkpoint's draw counter (the seed, element 0, must agree)
                elif not torch.equal(v, sums[k]):  # integer buffers cannot be averaged
                    raise CheckpointMismatch(f"{path}: integer tensor {k} differs from {paths[0]}")
        last = ckpt
    ref = first["state_dict"]
    mean = {k: v / len(paths) if v.is_floating_point() else v for k, v in sums.items()}
    constrain_mean_(first.get("model_config"), mean)
    state = {k: v.to(ref[k].dtype) if v.is_floating_point() else v for k, v in mean.items()}
    out = {k: v for k, v in last.items() if k not in TRAINING_STATE}
    out["state_dict"] = state
    out["averaged_from"] = [str(p) for p in paths]
    return out


def constrain_mean_(model_config: dict | None, mean: dict[str, torch.Tensor]) -> None:
    """The scheme's constraint (Seq2SeqTransformer.constrain_) on the averaged float64 weights `mean`
    (a checkpoint's state_dict, `model.`-prefixed), in place; nothing for a scheme without one."""
    from normlab.config import ModelConfig
    from normlab.model.schemes import get_scheme
    from normlab.model.transformer import Seq2SeqTransformer

    if not isinstance(model_config, dict):
        return
    cfg = ModelConfig.from_dict(model_config)
    if not get_scheme(cfg.norm.placement).constrained:
        return
    with torch.random.fork_rng(devices=[]):  # its random init must not move the run's RNG (the final test's)
        model = Seq2SeqTransformer(cfg).double()  # the mean's precision: one rounding, at the cast after
    model.load_state_dict({k[len("model."):]: v for k, v in mean.items() if k.startswith("model.")})
    model.constrain_()
    mean.update({f"model.{k}": v for k, v in model.state_dict().items()})


def save_checkpoint(ckpt: dict, path: str | os.PathLike) -> None:
    atomic_write_bytes(path, lambda f: torch.save(ckpt, f))
