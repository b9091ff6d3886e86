"""Loading a checkpoint never runs code from it, an unreadable one is a one-line error naming the
file at every entry point, a run folder resolves to its best checkpoint by recorded score, and
load_model needs neither Lightning nor Hydra."""
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normlab.checkpoint import CheckpointError, load_checkpoint, load_model, resolve_checkpoint, save_model
from normlab.checkpoint_io import AtomicCheckpointIO
from normlab.commands import average, evaluate, export_admin, prune, translate
from normlab.commands.common import main_guard
from normlab.commands.train import main as train_main
from normlab.config import ModelConfig
from normlab.model.transformer import Seq2SeqTransformer


class Payload:
    """Unpickling this calls open(marker, "w"): the file appears if the checkpoint's code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def evil(tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "code-ran"
    path = tmp_path / "shared.ckpt"
    torch.save({"model_config": {}, "state_dict": {}, "tokenizer_proto": b"spm", "x": Payload(marker)}, path)
    torch.load(path, weights_only=False).get("x").close()  # the payload works when code is allowed to run ...
    assert marker.exists()
    marker.unlink()  # ... and from here on it must never run
    return path, marker


def entry_points(ckpt: Path, tmp: Path) -> dict:
    text = tmp / "src.txt"
    text.write_text("ein Satz\n")
    return {
        "translate": lambda: main_guard(translate.main, [str(ckpt), "--input", str(text), "--quiet"]),
        "evaluate": lambda: main_guard(evaluate.main, [str(ckpt), "--src", str(text), "--ref", str(text), "--quiet"]),
        "average": lambda: main_guard(average.main, [str(ckpt), str(ckpt), "--output", str(tmp / "avg.ckpt")]),
        "prune": lambda: main_guard(prune.main, [str(ckpt), "--quiet"]),
        "export_admin": lambda: main_guard(export_admin.main, [str(ckpt), str(tmp / "plain.ckpt")]),
        "train resume=": lambda: train_main([f"resume={ckpt}", "logger=csv", f"hydra.run.dir={tmp / 'run'}"]),
    }


@pytest.mark.integration
def test_every_entry_point_refuses_a_checkpoint_that_would_run_code(evil, tmp_path, monkeypatch, capsys):
    path, marker = evil
    monkeypatch.chdir(tmp_path)
    for name, call in entry_points(path, tmp_path).items():
        assert call() == 2, name
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {path}: refused: it holds a Python object (io.open) that loading would construct or call"), (name, err)
        assert "\n" not in err and not marker.exists(), name
    assert not (tmp_path / "run").exists()
    # the library loaders and the strategy's checkpoint plugin (resume; the final passes: test_final_test.py)
    for load in (load_checkpoint, load_model, AtomicCheckpointIO().load_checkpoint):
        with pytest.raises(CheckpointError, match="refused"):
            load(path)
    assert not marker.exists()


def tiny_checkpoint(path: Path, **extra) -> Path:
    """A model-only checkpoint (no tokenizer: load_model gives tok None)."""
    model = Seq2SeqTransformer(ModelConfig(vocab_size=20, d_model=8, encoder_layers=1, decoder_layers=1,
                                           encoder_heads=2, decoder_heads=2, encoder_ffn=16, decoder_ffn=16))
    return save_model(path, model, **extra)


@pytest.mark.integration
@pytest.mark.parametrize("kind, what", [
    ("empty", "empty file, not a checkpoint"),
    ("truncated", "not a readable checkpoint, truncated or not a torch file"),
    ("text", "not a readable checkpoint, truncated or not a torch file"),
    ("folder", "no checkpoint found"),
    ("list", "not a checkpoint (a torch file holding a list)"),
    # not "a Python object": the unpickler stops at a byte that is no pickle opcode
    ("random bytes", "not a readable checkpoint, truncated or not a torch file (UnpicklingError: Unsupported "
                     "operand 254)"),
    # named before torch's unpickler prints its two-line warning about the protocol
    ("plain pickle", "not a torch checkpoint: a plain pickle (protocol 4), not a file torch.save wrote"),
])
def test_unreadable_checkpoint_is_one_line_naming_it_everywhere(kind, what, tmp_path, monkeypatch, capsys):
    path = tmp_path / f"{kind}.ckpt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        data = tiny_checkpoint(tmp_path / "whole.ckpt").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "text":
        path.write_text("this is not a checkpoint\n")
    elif kind == "folder":
        path.mkdir()
    elif kind == "random bytes":
        path.write_bytes(b"\xfe" + bytes(range(256)) * 16)  # 0xfe: no pickle opcode
    elif kind == "plain pickle":
        path.write_bytes(pickle.dumps({"state_dict": {"w": torch.zeros(2)}, "model_config": {}}, protocol=4))
    else:
        torch.save([1, 2], path)
    monkeypatch.chdir(tmp_path)
    for name, call in entry_points(path, tmp_path).items():
        if kind == "folder" and name in ("average", "train resume="):
            continue  # a list of checkpoint files / a file path: their own messages below
        assert call() == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: {what}") and err.count("\n") == 1, (name, err)
    with pytest.raises(CheckpointError):
        load_model(path)


def fake_best(path: Path, score: float, mode: str = "max") -> Path:
    """A top-k checkpoint as ModelCheckpoint saves it: its own score in best_k_models."""
    key = f"ModelCheckpoint{{'monitor': 'valid/bleu', 'mode': '{mode}', 'every_n_train_steps': 0}}"
    return tiny_checkpoint(path, callbacks={key: {"best_k_models": {f"/elsewhere/{path.name}": torch.tensor(score)},
                                                  "current_score": torch.tensor(score)}})


@pytest.mark.parametrize("mode, best", [("max", "best-step4.ckpt"), ("min", "best-step10.ckpt")])
def test_run_folder_resolves_to_the_best_recorded_score(mode, best, tmp_path):
    ckdir = tmp_path / "checkpoints"
    fake_best(ckdir / "best-step4.ckpt", 30.0, mode)  # sorted() by name would pick best-step10
    fake_best(ckdir / "best-step10.ckpt", 20.0, mode)
    tiny_checkpoint(ckdir / "last.ckpt")
    assert resolve_checkpoint(tmp_path).name == best
    assert resolve_checkpoint(ckdir).name == best


def test_run_folder_without_best_falls_back_to_last(tmp_path):
    tiny_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert resolve_checkpoint(tmp_path) == tmp_path / "checkpoints" / "last.ckpt"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        resolve_checkpoint(tmp_path / "empty")


def test_load_model_imports_neither_lightning_nor_hydra(tmp_path):
    path = tiny_checkpoint(tmp_path / "m.ckpt")
    code = ("import sys; from normlab.checkpoint import load_model; model, tok = load_model(sys.argv[1]); "
            "assert not model.training; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'hydra')]; "
            "sys.exit(f'imported: {bad}' if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
