"""Lightning's checkpoint plugin for normlab: atomic saves, weights-only loads.

Every checkpoint the Trainer's strategy reads (resume with `ckpt_path`; the final passes' weights,
scoring.load_weights) goes through normlab.checkpoint.load_checkpoint, so Lightning's own restore
path never unpickles code either, and an unreadable file is a one-line error naming it.
"""
from __future__ import annotations

from lightning.pytorch.plugins.io import TorchCheckpointIO

from normlab.checkpoint import atomic_write_bytes, load_checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saved via temp file + rename (a crash never leaves a truncated checkpoint behind the name
    `last.ckpt`); loaded weights-only."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if "://" in str(path):  # remote filesystems (s3://, gs://): Lightning's own writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        import torch

        atomic_write_bytes(path, lambda f: torch.save(checkpoint, f))

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        if "://" in str(path):
            return super().load_checkpoint(path, weights_only=True)
        return load_checkpoint(path)
