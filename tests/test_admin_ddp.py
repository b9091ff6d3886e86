"""Admin under DDP: rank 0 profiles, every rank ends with rank 0's ω (gloo, 2 CPU processes)."""
import json
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import pytest

from normlab.callbacks.admin_init import AdminInit
from normlab.config import ModelConfig
from normlab.init.admin import omega_values
from normlab.model.transformer import Seq2SeqTransformer


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(100 + rank)  # ranks start different on purpose
    cfg = ModelConfig(vocab_size=19, d_model=8, encoder_layers=2, decoder_layers=1, encoder_heads=2,
                      decoder_heads=2, encoder_ffn=16, decoder_ffn=16, max_positions=32, init="admin")
    model = Seq2SeqTransformer(cfg)
    g = torch.Generator().manual_seed(rank)  # and see different data: only rank 0's may count
    batches = [{"src": torch.randint(3, 19, (2, 5), generator=g), "tgt_in": torch.randint(3, 19, (2, 4), generator=g)}]
    trainer = SimpleNamespace(ckpt_path=None, is_global_zero=rank == 0, world_size=2, default_root_dir=out_dir,
                              datamodule=SimpleNamespace(train_dataloader=lambda: batches))
    AdminInit(mode="profile", batches=1).on_fit_start(trainer, SimpleNamespace(model=model, model_cfg=cfg))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(omega_values(model), f)
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~15 CPU-s, over a minute on the shared CPU
def test_rank_zero_profiles_and_broadcasts(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1
    saved = json.loads((tmp_path / "admin_omega.json").read_text())["omega"]
    assert {k: v[0] for k, v in r0.items()} == saved  # what rank 0 profiled and wrote
    assert len(set(saved.values())) == len(saved) - 1  # distinct profiled values; two ω_1 = 1
