"""Checkpoints that are never half-written, and loading a model without Lightning or Hydra.

A Lightning checkpoint from normlab carries `model_config` (the ModelConfig as a dict) and
`tokenizer_proto` (the sentencepiece model bytes), so `load_model(path)` rebuilds the network
and its tokenizer in a plain Python session.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from normlab.config import ModelConfig


def atomic_write_bytes(path: str | os.PathLike, write) -> None:
    """Write through a temporary file in the same folder, then rename: readers see old or new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write_bytes(path, lambda f: f.write(json.dumps(data, indent=2, sort_keys=True).encode()))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO, but saved via temp file + rename (a crash never leaves a
    truncated checkpoint behind the name `last.ckpt`)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if "://" in str(path):  # remote filesystems (s3://, gs://): Lightning's own writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_write_bytes(path, lambda f: torch.save(checkpoint, f))


def load_checkpoint(path: str | os.PathLike) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def model_from_checkpoint(ckpt: dict):
    from normlab.model.transformer import Seq2SeqTransformer

    cfg = ModelConfig.from_dict(ckpt["model_config"])
    model = Seq2SeqTransformer(cfg)
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(state)
    return model.eval()


def load_model(path: str | os.PathLike):
    """(model in eval mode, tokenizer) from a checkpoint file or a run folder."""
    from normlab.data.tokenizer import Tokenizer

    path = resolve_checkpoint(path)
    ckpt = load_checkpoint(path)
    tok = Tokenizer.from_proto(ckpt["tokenizer_proto"]) if "tokenizer_proto" in ckpt else None
    return model_from_checkpoint(ckpt), tok


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run folder resolves to its best checkpoint, else last.ckpt."""
    path = Path(path)
    if path.is_file():
        return path
    ckdir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    best = sorted(p for p in ckdir.glob("best*.ckpt"))
    for cand in best + [ckdir / "last.ckpt"]:
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no checkpoint found at {path} (looked for a .ckpt file, "
                            f"{ckdir}/best*.ckpt and {ckdir}/last.ckpt)")


def save_model(path: str | os.PathLike, model, tokenizer_proto: bytes | None = None, **extra: Any) -> Path:
    """An ordinary normlab checkpoint (model_config + "model."-prefixed state_dict [+ tokenizer])
    from a bare model, e.g. a pruned one; `load_model(path)` reads it back."""
    ckpt: dict[str, Any] = {"model_config": model.cfg.to_dict(),
                            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, **extra}
    if tokenizer_proto is not None:
        ckpt["tokenizer_proto"] = tokenizer_proto
    atomic_write_bytes(path, lambda f: torch.save(ckpt, f))
    return Path(path)
