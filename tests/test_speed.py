"""Speed features: no host syncs in the training step, fused Adam on GPU (foreach on CPU), model.compile."""
import csv
import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from normlab.lit_module import Seq2SeqModule
from normlab.model.transformer import Seq2SeqTransformer
from normlab.settings import OptimSpec
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
        name = func._schema.name
        if name in SYNC_OPS:
            self.ops.append(name)
        elif name in MASK_OPS and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                                      for t in _flat(args)):  # the output size depends on device values
            self.ops.append(f"{name} (boolean mask)")
        elif name == "aten::bincount":  # sizes its output by the input's max, read back
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


MASK_OPS = ("aten::index", "aten::masked_select", "aten::index_put_", "aten::index_put")


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _run(small_corpus, tmp_path, *extra):
    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + FAST + list(extra))
    return run(cfg), tmp_path / "run"


@pytest.mark.integration
def test_training_step_reads_nothing_back_from_the_device(small_corpus, tmp_path, monkeypatch):
    counted = []
    step = Seq2SeqModule.training_step

    def counting_step(self, batch, batch_idx):
        with SyncCounter() as c:
            out = step(self, batch, batch_idx)
        counted.append(c.ops)
        return out

    monkeypatch.setattr(Seq2SeqModule, "training_step", counting_step)
    asked = []  # the device train.py hands to shape_free_sdpa: the one the run trains on
    monkeypatch.setattr("normlab.train.shape_free_sdpa", asked.append)
    results, run_dir = _run(small_corpus, tmp_path)
    assert results["status"] == "completed" and len(counted) == 6
    assert asked == [torch.device("cpu")]
    assert counted == [[]] * 6
    # Losses are logged on the logger's steps only (log_every_n_steps=2), and every one of them.
    rows = [r for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [1, 3, 5]


def test_adam_is_fused_on_gpu_with_foreach_on_cpu():
    module = SimpleNamespace(optim_spec=OptimSpec(clip_norm=0.0), spikes=None,  # spike skipping off
                             _attached_trainer=lambda: SimpleNamespace(precision="bf16-mixed"))

    def on(device_type):
        params = [SimpleNamespace(device=torch.device(device_type))]
        return Seq2SeqModule._adam_impl(SimpleNamespace(**vars(module), parameters=lambda: iter(params)))

    assert on("cpu") == {"foreach": True}
    assert on("cuda") == {"fused": True}
    assert on("meta") == {}


def test_shape_free_sdpa_leaves_cudnn_out_on_cuda_only(monkeypatch):
    """cuDNN's attention plans each new shape (278 ms a step on an H100 where flash ran 27 ms:
    model/attention.py); off on CUDA, nothing changed on CPU."""
    from normlab.model.attention import shape_free_sdpa

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    assert shape_free_sdpa("cpu") is False and shape_free_sdpa(torch.device("cpu")) is False and calls == []
    assert shape_free_sdpa(torch.device("cuda", 0)) is True and calls == [False]
    assert shape_free_sdpa("cuda") is True and calls == [False, False]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true", "bf16-true"])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_the_adam_chosen_for_a_gpu_is_one_lightning_clips(precision, clip):
    """Lightning's precision plugin for `precision` clips the gradients of the Adam adam_on_gpu builds
    (fused Adam CPU kernels stand in for CUDA's: the refusal reads the optimizer, not the device). On an
    H100 (2026-11-27) trainer=gpu with optim.clip_norm=1.0 stopped at its first step: Lightning refuses
    clipping for a fused optimizer under bf16-mixed too, not only fp16's loss scaling."""
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from normlab.lit_module import adam_on_gpu

    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 2.0)
    opt = torch.optim.Adam([w], **adam_on_gpu(precision, clip > 0))
    plugin = (MixedPrecision(precision, "cpu", scaler=torch.amp.GradScaler("cpu") if precision == "16-mixed" else None)
              if "mixed" in precision else Precision())
    plugin.clip_gradients(opt, clip)  # raises RuntimeError for a fused Adam under mixed precision
    norm = float(w.grad.norm())
    assert norm == pytest.approx(min(clip, 12 ** 0.5) if clip else 12 ** 0.5, rel=1e-5)
    if clip == 0.0 or "mixed" not in precision:
        assert opt.defaults["fused"], "fused wherever Lightning allows it"


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_foreach_adam_on_cpu_is_the_default_loop_bit_for_bit(weight_decay):
    # CPU training takes foreach Adam (fewer Python calls per parameter) only because its values are
    # the default per-parameter loop's exactly; CPU's fused kernel differs in the last bits.
    from normlab.config import ModelConfig
    from normlab.model.transformer import Seq2SeqTransformer

    def train(**impl):
        torch.manual_seed(0)
        model = Seq2SeqTransformer(ModelConfig(vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1,
                                               encoder_heads=2, decoder_heads=2, encoder_ffn=32, decoder_ffn=32))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9,
                               weight_decay=weight_decay, **impl)
        for _ in range(3):
            src, tgt = torch.randint(3, 50, (4, 7)), torch.randint(3, 50, (4, 6))
            opt.zero_grad(set_to_none=True)
            model(src, tgt).logsumexp(-1).mean().backward()
            opt.step()
        return [*model.parameters(), *(v for st in opt.state.values() for v in st.values())]

    loop, foreach = train(foreach=False), train(foreach=True)
    assert all(torch.equal(a, b) for a, b in zip(loop, foreach, strict=True))


@pytest.mark.integration
@pytest.mark.slow  # model.compile is off by default (0.18-0.77x per run on this CPU: benchmarks/README.md); make test-slow
def test_compiled_model_trains_like_the_eager_one_and_reports_compile_time(small_corpus, tmp_path):
    # aot_eager traces forward and backward as inductor does, without its minutes of C++ builds.
    eager, _ = _run(small_corpus, tmp_path / "eager")
    compiled, run_dir = _run(small_corpus, tmp_path / "compiled", "model.compile=aot_eager")
    assert compiled["status"] == "completed" and compiled["compile_s"] > 0
    assert "compile_s" not in eager
    assert compiled["valid_loss"] == pytest.approx(eager["valid_loss"], rel=1e-4)
    assert json.loads((run_dir / "results.json").read_text())["compile_s"] == compiled["compile_s"]


@pytest.mark.integration
def test_bad_compile_value_names_the_key(small_corpus, tmp_path):
    from normlab.config import ConfigError

    with pytest.raises(ConfigError, match="model.compile: 'fastest' is not valid"):
        _run(small_corpus, tmp_path, "model.compile=fastest")


@pytest.mark.integration
@pytest.mark.slow
def test_compile_with_inductor_on_cpu(small_corpus, tmp_path):
    results, _ = _run(small_corpus, tmp_path, "model.compile=true", "trainer.max_steps=2")
    assert results["status"] == "completed" and results["compile_s"] > 0


HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
         "on_before_optimizer_step", "configure_gradient_clipping", "on_before_zero_grad", "optimizer_step",
         "training_step", "backward")


@pytest.mark.integration
def test_no_hook_of_the_default_loop_reads_back_from_the_device_on_a_non_logging_step(small_corpus, tmp_path,
                                                                                     monkeypatch):
    """Every default callback's per-step hooks and the module's, wrapped in the dispatch-level counter:
    on a step where nothing is logged, none reads a device value back (on a GPU each would make the
    host wait for the queue) but the divergence guard's two. Logging steps may (the logged values
    are read once there)."""
    import lightning.pytorch as pl

    import normlab.callbacks  # noqa: F401
    from normlab import train as train_mod

    counted: list[tuple[int, str, str, list]] = []

    seen: dict = {}  # the trainer of the last hook that had one (the model's constrain_ has none)

    def counting(fn, who, name):
        def hook(*a, **k):
            trainer = next((x for x in a if isinstance(x, pl.Trainer)), None)
            if trainer is None and isinstance(a[0], Seq2SeqModule):
                trainer = a[0].trainer
            if trainer is None:
                trainer = seen["trainer"]
            seen["trainer"] = trainer
            with SyncCounter() as c:
                out = fn(*a, **k)
            counted.append((trainer.global_step, who, name, c.ops))
            return out
        return hook

    build = train_mod.build_callbacks

    def build_counted(*args, **kwargs):
        callbacks = build(*args, **kwargs)
        for cb in callbacks:
            for name in HOOKS:
                owner = next((k for k in type(cb).__mro__ if name in k.__dict__), None)
                if owner is not None and owner.__module__.startswith("normlab"):
                    setattr(cb, name, counting(getattr(cb, name), type(cb).__name__, name))
        return callbacks

    monkeypatch.setattr(train_mod, "build_callbacks", build_counted)
    # The module's optimizer_step holds Lightning's whole step (the closure's training_step, backward and
    # clipping, each counted itself, and torch's optimizer, whose CPU step counters Adam reads with .item()):
    # what the module adds there, the scheme's constraint (nGPT's; none for the default), is counted instead.
    for name in (*HOOKS, "constrain_"):
        owner = Seq2SeqTransformer if name == "constrain_" else Seq2SeqModule
        if name != "optimizer_step" and name in owner.__dict__:
            monkeypatch.setattr(owner, name, counting(owner.__dict__[name], owner.__name__, name))
    results, _ = _run(small_corpus, tmp_path, "trainer.log_every_n_steps=4", "trainer.max_steps=9",
                      "callbacks.stall.window=2", "callbacks.stall.patience=2", "callbacks.stall.after_step=0", "callbacks.stall.stop_after=100")  # decides often
    assert results["status"] == "completed"
    hooks = {(who, name) for _, who, name, _ in counted}
    assert ("Seq2SeqModule", "training_step") in hooks and ("DivergenceGuard", "on_train_batch_end") in hooks
    assert ("StallGuard", "on_train_batch_end") in hooks and ("Seq2SeqTransformer", "constrain_") in hooks
    # steps 1-2, 5-6 log nothing (log_every_n_steps=4 logs after steps 3 and 7 ... as Lightning counts)
    syncing = [(s, who, name, ops) for s, who, name, ops in counted if ops and (s + 1) % 4 != 0 and s % 4 != 0]
    # Left (issue 18): one read of the update's gradient norm before the optimizer step (the module
    # measures it once: a non-finite or spiking update is skipped, issue 38) and the divergence guard's
    # read of the loss after it. Every other hook reads nothing back; a new read anywhere fails here.
    # The stall guard reads its window back once per window (every 2 steps here, 50 by default) to decide.
    known = {("Seq2SeqModule", "configure_gradient_clipping"), ("DivergenceGuard", "on_train_batch_end")}
    assert all(((who, name) in known and len(ops) == 1) or (who, name, s % 2) == ("StallGuard", "on_train_batch_end", 0)
               for s, who, name, ops in syncing), "\n".join(map(str, syncing))
