"""Checkpoints are never half-written: a failure during saving leaves the old file intact."""
import pytest
import torch

from normlab.checkpoint import write_json
from normlab.checkpoint_io import AtomicCheckpointIO


class Boom:
    def __reduce__(self):  # torch.save pickles this after writing part of the file
        raise RuntimeError("disk full")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000), "bad": Boom()}, path)
    assert path.read_bytes() == before
    assert torch.load(path, weights_only=False)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temp file left behind


def test_save_replaces_and_loads(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "sub" / "x.ckpt"
    io.save_checkpoint({"step": 1}, path)
    io.save_checkpoint({"step": 2}, path)
    assert io.load_checkpoint(path)["step"] == 2


def test_write_json_is_atomic(tmp_path):
    path = tmp_path / "results.json"
    write_json(path, {"status": "completed"})
    with pytest.raises(TypeError):
        write_json(path, {"bad": object()})
    assert path.read_text().strip().startswith("{") and "completed" in path.read_text()
