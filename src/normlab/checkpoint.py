"""Checkpoints that are never half-written, loaded without running code, and a model rebuilt
without Lightning or Hydra.

A Lightning checkpoint from normlab carries `model_config` (the ModelConfig as a dict) and
`tokenizer_proto` (the sentencepiece model bytes), so `load_model(path)` rebuilds the network
and its tokenizer in a plain Python session (this module imports neither Lightning nor Hydra;
Lightning's checkpoint plugin lives in normlab.checkpoint_io).

`load_checkpoint` is the one loader of every command, of resume / fine-tune and of Lightning's
own restore path (AtomicCheckpointIO): weights-only unpickling, so a shared checkpoint can hold
tensors and plain values but never code that runs on load; an unreadable file (empty,
truncated, not a checkpoint) is a `CheckpointError` naming it.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from normlab.config import ModelConfig
from normlab.errors import UserError
from normlab.file_mode import atomic_write_bytes, creation_mode  # noqa: F401 (atomic_write_bytes: this module's writers and its callers)


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used: missing, unreadable, unsafe or not normlab's."""


def write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write_bytes(path, lambda f: f.write(json.dumps(data, indent=2, sort_keys=True).encode()))


def load_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict:
    """The checkpoint dict, unpickled weights-only on CPU (mmap: tensors are read on first use)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(str(path), "is a folder, not a checkpoint file" if path.is_dir()
                              else "no such checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(str(path), "empty file, not a checkpoint")
    with open(path, "rb") as f:
        head = f.read(4)
    zipped = head == b"PK\x03\x04"  # torch.save's format since torch 1.6; the older one is a pickle stream
    if not zipped and head[:1] == b"\x80" and head[1:2] > b"\x02":  # pickle's PROTO opcode, and its version
        # torch.save's older format opens with a protocol-2 pickle: this is a plain pickle.dump (torch's
        # unpickler would print a two-line warning about the protocol, then fail on the file)
        raise CheckpointError(str(path), f"not a torch checkpoint: a plain pickle (protocol {head[1]}), not a file "
                                         "torch.save wrote")
    try:
        with warnings.catch_warnings():  # a torch.save(..., pickle_protocol=4) file loads as any other
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            # the older format cannot be memory-mapped: read whole (torch.load would refuse it)
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipped)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found:  # the weights-only unpickler stopped at a reference to code: a class or a function
            raise CheckpointError(
                str(path), f"refused: it holds a Python object ({found.group(1)}) that loading would construct or "
                "call; normlab loads only tensors and plain values from a checkpoint") from None
        # anything else it stops at (random bytes, a file of another format) is not a checkpoint
        raise CheckpointError(str(path), f"not a readable checkpoint, truncated or not a torch file "
                                         f"({_unpickler_said(e)})") from None
    except Exception as e:  # truncated zip, a text file, a pickle cut short: any of torch's errors
        raise CheckpointError(str(path), f"not a readable checkpoint, truncated or not a torch file "
                                         f"({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(ckpt, dict):
        raise CheckpointError(str(path), f"not a checkpoint (a torch file holding a {type(ckpt).__name__})")
    return ckpt


def _unpickler_said(e: BaseException) -> str:
    """What the weights-only unpickler stopped at, without torch's advice around it (which offers to
    load the file with code execution on)."""
    text = str(e)
    inner = text.split("\n\n", 1)[1] if "\n\n" in text else text.removeprefix("Weights only load failed.")
    return f"{type(e).__name__}: {_first_line(inner) or 'not a pickle of tensors and plain values'}"


def _first_line(e: object) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def model_from_checkpoint(ckpt: dict, source: str | os.PathLike = "checkpoint"):
    from normlab.model.transformer import Seq2SeqTransformer

    if not isinstance(ckpt.get("model_config"), dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(str(source), "not a normlab checkpoint (no model_config / state_dict)")
    cfg = ModelConfig.from_dict(ckpt["model_config"])
    model = Seq2SeqTransformer(cfg)
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise CheckpointError(str(source), f"its weights do not fit its model_config ({_first_line(e)})") from None
    return model.eval()


def load_model(path: str | os.PathLike):
    """(model in eval mode, tokenizer) from a checkpoint file or a run folder."""
    from normlab.data.tokenizer import Tokenizer

    path = resolve_checkpoint(path)
    ckpt = load_checkpoint(path)
    tok = None
    if "tokenizer_proto" in ckpt:
        try:
            tok = Tokenizer.from_proto(ckpt["tokenizer_proto"])
        except (RuntimeError, TypeError, ValueError) as e:  # sentencepiece cannot parse it
            raise CheckpointError(str(path), f"its tokenizer_proto is not a sentencepiece model ({_first_line(e)})") from None
    return model_from_checkpoint(ckpt, path), tok


def recorded_score(path: str | os.PathLike) -> tuple[float, str] | None:
    """(score, mode) that ModelCheckpoint recorded in a top-k checkpoint when it saved it (the
    entry of its best_k_models for this file), or None. Tensors are memory-mapped, not read."""
    callbacks = load_checkpoint(path, mmap=True).get("callbacks") or {}
    for key, state in callbacks.items():
        if not (str(key).startswith("ModelCheckpoint") and isinstance(state, dict)):
            continue
        for saved, score in (state.get("best_k_models") or {}).items():
            if Path(str(saved)).name == Path(path).name and score is not None:
                mode = re.search(r"'mode': '(\w+)'", str(key))
                return float(score), mode.group(1) if mode else "max"
    return None


def _step_of(path: Path) -> int:
    m = re.search(r"step(\d+)", path.name)
    return int(m.group(1)) if m else -1


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run folder resolves to its best checkpoint (by the score ModelCheckpoint recorded in each
    best*.ckpt; ties and unscored files: the latest step), else last.ckpt."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(str(path), "no such checkpoint file or run folder")
    ckdir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    best = sorted(ckdir.glob("best*.ckpt"), key=_step_of)
    if len(best) > 1:
        def rank(p: Path) -> tuple:
            rec = recorded_score(p)
            if rec is None:
                return (0, 0.0, _step_of(p))
            score, mode = rec
            return (1, score if mode == "max" else -score, _step_of(p))
        best = [max(best, key=rank)]
    for cand in best + [ckdir / "last.ckpt"]:
        if cand.is_file():
            return cand
    raise CheckpointError(str(path), f"no checkpoint found (looked for {ckdir}/best*.ckpt and {ckdir}/last.ckpt)")


def save_model(path: str | os.PathLike, model, tokenizer_proto: bytes | None = None, **extra: Any) -> Path:
    """An ordinary normlab checkpoint (model_config + "model."-prefixed state_dict [+ tokenizer])
    from a bare model, e.g. a pruned one; `load_model(path)` reads it back."""
    ckpt: dict[str, Any] = {"model_config": model.cfg.to_dict(),
                            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, **extra}
    if tokenizer_proto is not None:
        ckpt["tokenizer_proto"] = tokenizer_proto
    atomic_write_bytes(path, lambda f: torch.save(ckpt, f))
    return Path(path)
