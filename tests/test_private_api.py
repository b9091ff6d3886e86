"""normlab.private_api: each private use of Lightning / W&B / torch, called on the pinned versions,
with the behaviour normlab relies on; an upgrade that renames or changes one fails here, by name."""
import lightning as L
import torch
from torch import nn

from normlab import private_api as api


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.logged: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.logged.append(api.logs_this_step(self))
        return self.lin(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("v", self.lin(batch).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)


class _Record(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((batch_idx, api.should_accumulate(trainer), api.validation_due(trainer)))


def test_lightning_fit_loop_and_logger_connector(tmp_path):
    rec = _Record()
    module = _Tiny()
    assert api.logs_this_step(module) is False  # no trainer
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, val_check_interval=4, log_every_n_steps=2,
                        callbacks=[rec], logger=L.pytorch.loggers.CSVLogger(tmp_path), enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                        accelerator="cpu")
    trainer.fit(module)
    # 8 micro-batches = 4 updates of 2: the first of each pair is within an update
    assert [a for _, a, _ in rec.rows] == [True, False] * 4
    # validation every 4 micro-batches (val_check_interval counts batches)
    assert [v for _, _, v in rec.rows] == [False, False, False, True] * 2
    # the connector writes every 2nd update: Lightning asks before the step (`+ 1`)
    assert module.logged == [False, False, True, True, False, False, True, True]


def test_wandb_logger_init_keywords(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(save_dir=str(tmp_path), project="p")
    assert "anonymous" in logger._wandb_init
    api.drop_wandb_init_key(logger, "anonymous")
    assert "anonymous" not in logger._wandb_init


def test_torch_global_module_hooks():
    from torch.nn.modules.module import register_module_forward_hook

    assert api.global_module_hooks() is False
    handle = register_module_forward_hook(lambda m, i, o: None)
    try:
        assert api.global_module_hooks() is True
    finally:
        handle.remove()
    assert api.global_module_hooks() is False


def test_overridden_lightning_methods_still_exist_and_are_called(tmp_path):
    """BestCheckpoint overrides ModelCheckpoint._monitor_candidates: a rename in Lightning would
    silently bypass the override (a loss-only validation would then fail the run)."""
    import importlib

    from normlab.callbacks.checkpoints import BestCheckpoint

    for path, names in api.OVERRIDDEN.items():
        module, cls = path.rsplit(".", 1)
        klass = getattr(importlib.import_module(module), cls)
        for name in names:
            assert callable(getattr(klass, name, None)), f"{path}.{name} is gone"

    calls = []

    class Spy(BestCheckpoint):
        def _monitor_candidates(self, trainer):
            calls.append(trainer.global_step)
            return super()._monitor_candidates(trainer)

    spy = Spy(monitor="v", mode="min", dirpath=str(tmp_path))
    trainer = L.Trainer(max_steps=4, val_check_interval=2, limit_val_batches=1, callbacks=[spy], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=str(tmp_path))
    trainer.fit(_Tiny())
    assert calls and spy.best_model_path  # called on validation end, and the best was saved through it


def test_tensor_version_counts_in_place_changes():
    t = torch.zeros(3, dtype=torch.bool)
    v0 = api.tensor_version(t)
    t[0] = True
    assert api.tensor_version(t) == v0 + 1
    assert api.tensor_version(t.clone()) == 0


def test_reset_hydra_lets_compose_initialise_again(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    (tmp_path / "c.yaml").write_text("a: 1\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        assert compose(config_name="c").a == 1
        assert GlobalHydra.instance().is_initialized()
        api.reset_hydra()
        assert not GlobalHydra.instance().is_initialized()
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):  # no "already initialized"
        assert compose(config_name="c", overrides=["a=2"]).a == 2
    api.reset_hydra()


def test_hydra_app_argv_feeds_hydra_main_and_restores(tmp_path, monkeypatch):
    import hydra
    from hydra.core.hydra_config import HydraConfig

    (tmp_path / "c.yaml").write_text("a: 1\n")
    seen = []

    def task(cfg):
        seen.append((cfg.a, HydraConfig.initialized()))
        job = api.hydra_job_config()  # what .hydra/hydra.yaml holds: {hydra: ...}
        assert list(job) == ["hydra"] and list(job.hydra.overrides.task)[0] == "a=5"

    app = hydra.main(version_base="1.3", config_path=str(tmp_path), config_name="c")(task)
    monkeypatch.setattr("sys.argv", ["prog", "ignored=1"])
    with api.hydra_app_argv(["a=5", f"hydra.run.dir={tmp_path / 'out'}", "hydra.output_subdir=null"]):
        app()
    import sys

    assert seen == [(5, True)]
    assert sys.argv == ["prog", "ignored=1"]
    assert not HydraConfig.initialized()  # the run's Hydra config is not left for the caller


def test_torch_module_hooks_of_one_module():
    """Dropout.add takes the hooked path only when a hook would see it (Admin's profiling)."""
    m = nn.Linear(2, 2)
    assert api.module_hooks(m) is False
    for register in (m.register_forward_hook, m.register_forward_pre_hook):
        handle = register(lambda *a: None)
        assert api.module_hooks(m) is True
        handle.remove()
        assert api.module_hooks(m) is False


def test_foreach_norms_are_each_tensors_norm():
    ts = [torch.arange(6.0).view(2, 3), torch.tensor([3.0, -4.0]), torch.zeros(4)]
    assert torch.stack(api.foreach_norms(ts)).tolist() == [torch.linalg.vector_norm(t).item() for t in ts]


def test_numpy_memmap_exposes_its_mmap(tmp_path):
    """TokenArray.open advises the kernel (MADV_RANDOM) through the memmap's own mmap object."""
    import mmap

    import numpy as np

    path = tmp_path / "a.bin"
    np.arange(4096, dtype=np.int32).tofile(path)
    arr = np.memmap(path, dtype=np.int32, mode="r", shape=(4096,))
    mm = api.numpy_mmap(arr)
    assert isinstance(mm, mmap.mmap) and len(mm) == path.stat().st_size
    if hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    assert api.numpy_mmap(np.zeros(3)) is None and int(arr[4095]) == 4095


def test_a_fused_optimizer_says_it_unscales_in_its_step():
    """lit_module clips with its own norm unless the grads are still fp16-scaled there: a fused Adam
    unscales inside its step (GradScaler then leaves the grads scaled), foreach Adam and Muon+AdamW do not."""
    from normlab.optimizers import MuonWithAdamW

    w, v = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    assert api.unscales_in_step(torch.optim.Adam([v], fused=True)) is True
    assert api.unscales_in_step(torch.optim.Adam([v], foreach=True)) is False
    assert api.unscales_in_step(MuonWithAdamW([{"params": [w]}], [{"params": [v]}], {}, {})) is False


def test_the_pending_loss_scale_is_the_scalers_tensor_for_a_fused_optimizer_only():
    """GradScaler._get_scale_async: the scale as a tensor (no host sync), None before the first scale()."""
    from types import SimpleNamespace

    v = nn.Parameter(torch.randn(3))
    fused, foreach = torch.optim.Adam([v], fused=True), torch.optim.Adam([v], foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    plugin = SimpleNamespace(scaler=scaler)
    assert api.pending_loss_scale(plugin, fused) is None  # nothing scaled yet
    scaler.scale(v.sum()).backward()
    scale = api.pending_loss_scale(plugin, fused)
    assert isinstance(scale, torch.Tensor) and scale.item() == 256.0 and torch.equal(v.grad, torch.full((3,), 256.0))
    assert api.pending_loss_scale(plugin, foreach) is None and api.pending_loss_scale(SimpleNamespace(), fused) is None


def test_saved_last_is_what_model_checkpoint_reads_at_train_end(tmp_path):
    """ModelCheckpoint(save_last=True).on_train_end writes last.ckpt unless this process saved one:
    saved_last marks it saved (a continued run's BestCheckpoint, callbacks/checkpoints.py)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    calls = []
    cb = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    cb._save_last_checkpoint = lambda *args: calls.append(args)
    api.saved_last(cb, str(tmp_path / "last.ckpt"))
    cb.on_train_end(None, None)
    assert calls == []
