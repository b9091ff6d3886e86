"""Speed features: no host syncs in the training step, fused Adam on GPU, model.compile."""
import csv
import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from normlab.lit_module import Seq2SeqModule
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

# Ops that copy a device value to the host (on GPU the CPU then waits for the queue to drain).
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero")
FAST = ["eval.valid_bleu=false", "eval.test=false", "trainer.val_check_interval=8", "trainer.max_steps=6"]


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNC_OPS:
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _run(small_corpus, tmp_path, *extra):
    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + FAST + list(extra))
    return run(cfg), tmp_path / "run"


def test_training_step_reads_nothing_back_from_the_device(small_corpus, tmp_path, monkeypatch):
    counted = []
    step = Seq2SeqModule.training_step

    def counting_step(self, batch, batch_idx):
        with SyncCounter() as c:
            out = step(self, batch, batch_idx)
        counted.append(c.ops)
        return out

    monkeypatch.setattr(Seq2SeqModule, "training_step", counting_step)
    results, run_dir = _run(small_corpus, tmp_path)
    assert results["status"] == "completed" and len(counted) == 6
    assert counted == [[]] * 6
    # Losses are logged on the logger's steps only (log_every_n_steps=2), and every one of them.
    rows = [r for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [1, 3, 5]


def test_adam_is_fused_on_gpu_unless_fp16_scaling_meets_clipping():
    module = SimpleNamespace(optim_cfg={"clip_norm": 0.0}, _trainer=SimpleNamespace(precision="bf16-mixed"))
    impl = Seq2SeqModule._adam_impl

    def on(device_type, **kw):
        params = [SimpleNamespace(device=torch.device(device_type))]
        return impl(SimpleNamespace(**vars(module), **kw, parameters=lambda: iter(params)))

    assert on("cpu") == {}
    assert on("cuda") == {"fused": True}
    fp16_clip = {"optim_cfg": {"clip_norm": 1.0}, "_trainer": SimpleNamespace(precision="16-mixed")}
    assert impl(SimpleNamespace(**fp16_clip, parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda"))]))) == {}


def test_compiled_model_trains_like_the_eager_one_and_reports_compile_time(small_corpus, tmp_path):
    # aot_eager traces forward and backward as inductor does, without its minutes of C++ builds.
    eager, _ = _run(small_corpus, tmp_path / "eager")
    compiled, run_dir = _run(small_corpus, tmp_path / "compiled", "model.compile=aot_eager")
    assert compiled["status"] == "completed" and compiled["compile_s"] > 0
    assert "compile_s" not in eager
    assert compiled["valid_loss"] == pytest.approx(eager["valid_loss"], rel=1e-4)
    assert json.loads((run_dir / "results.json").read_text())["compile_s"] == compiled["compile_s"]


def test_bad_compile_value_names_the_key(small_corpus, tmp_path):
    from normlab.config import ConfigError

    with pytest.raises(ConfigError, match="model.compile: 'fastest' is not valid"):
        _run(small_corpus, tmp_path, "model.compile=fastest")


@pytest.mark.slow
def test_compile_with_inductor_on_cpu(small_corpus, tmp_path):
    results, _ = _run(small_corpus, tmp_path, "model.compile=true", "trainer.max_steps=2")
    assert results["status"] == "completed" and results["compile_s"] > 0
