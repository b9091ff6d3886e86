"""DDP equivalence: 2 CPU processes (gloo) with LayerDrop give the gradients of 1 process over the
same global batch, skip the same layers, and need no find_unused_parameters; also for the residual
schemes whose structure differs most (ResiDual's second stream, ReZero's zero-initialised scale,
DLCL's and DWA's weight matrices whose upper triangles are never used)."""
import gc
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from normlab.config import ModelConfig
from normlab.model.transformer import Seq2SeqTransformer

V, STEPS = 31, 3
# (p, rates, model options): random skips; learned rates; p = 1, every layer skipped (then the
# encoder output reaches the loss only through the skipped decoder layers' zero term); schemes
CASES = {"uniform": (0.5, "uniform", {}), "learned": (0.5, "learned", {}), "all_skipped": (1.0, "uniform", {}),
         "resi_dual": (0.5, "uniform", {"norm": {"placement": "resi_dual"}}),
         "rezero": (0.5, "uniform", {"norm": {"placement": "rezero", "type": "none"}}),
         "dlcl_sandwich": (0.0, "uniform", {"norm": {"placement": "sandwich"}, "layer_aggregation": "dlcl"}),
         "dwa_post": (0.0, "uniform", {"norm": {"placement": "post"}, "layer_aggregation": "dwa"})}
RATES = tuple(CASES)
JOIN_TIMEOUT_S = 300  # the ranks take ~15 s of CPU


def make_model(case: str) -> Seq2SeqTransformer:
    p, rates, options = CASES[case]
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=16, encoder_layers=4, decoder_layers=4, encoder_heads=2, decoder_heads=2,
                      encoder_ffn=24, decoder_ffn=24, max_positions=32,
                      regularizer=dict(encoder_layerdrop=p, decoder_layerdrop=p, layerdrop_rates=rates), **options)
    return Seq2SeqTransformer(cfg)


def global_batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        src, tgt_in, tgt_out = (torch.randint(3, V, (4, n), generator=g) for n in (7, 6, 6))
        src[1, 5:] = 0  # ragged rows: ranks pad differently from the single process
        tgt_in[2, 4:] = 0
        tgt_out[2, 3:] = 0
        out.append((src, tgt_in, tgt_out))
    return out


def summed_loss(model, src, tgt_in, tgt_out):
    logits = model(src, tgt_in)
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=0, reduction="sum"), tgt_out.ne(0).sum()


def train(model, batches, rank=0, world=1):
    # As Seq2SeqModule.training_step: loss summed over tokens / (global tokens / world); DDP then
    # averages over ranks, so every run takes the gradient of (sum over the global batch) / tokens.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = model.module if isinstance(model, DDP) else model
    record = []
    for src, tgt_in, tgt_out in batches:
        rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
        loss, ntok = summed_loss(model, src[rows], tgt_in[rows], tgt_out[rows])
        total = ntok.clone().float()
        if world > 1:
            dist.all_reduce(total)
        opt.zero_grad(set_to_none=True)
        (loss / (total / world)).backward()
        grads = torch.cat([p.grad.flatten() for p in inner.parameters()])
        kept = tuple(getattr(s.layers, "last_kept", list(range(len(s.layers)))) for s in (inner.encoder, inner.decoder))
        record.append({"grads": grads.clone(), "kept": kept})
        opt.step()
    return record


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    ddp = None
    try:
        for rates in RATES:
            torch.manual_seed(100 + rank)  # different global RNG per rank: LayerDrop must not depend on it
            ddp = DDP(make_model(rates))  # default find_unused_parameters=False
            torch.save(train(ddp, global_batches(), rank, world), os.path.join(out_dir, f"{rates}{rank}.pt"))
            # Freed here, while both ranks are in the group: a DDP's Reducer holds the process group, and
            # freeing it after destroy_process_group (at the frame's end) once hung a rank for good in
            # ~ProcessGroupGloo, its peer gone (make test, 2026-11-28: a stack taken with gdb)
            ddp = None
            gc.collect()  # a reference cycle would otherwise keep the Reducer until a later collection
        dist.barrier()
    finally:
        ddp = None  # also on an error in train(): the group is torn down with no DDP holding it
        gc.collect()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_or_fail(ranks, timeout_s: float) -> None:
    """Wait for the ranks; one that hangs is killed and fails the test, not the whole suite."""
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=0.5):
        if time.monotonic() > deadline:
            for proc in ranks.processes:
                proc.kill()
                proc.join()
            pytest.fail(f"the ranks did not finish in {timeout_s} s")


def _hang(rank):
    time.sleep(120)


def test_a_rank_that_hangs_fails_the_test_in_bounded_time():
    ranks = mp.start_processes(_hang, nprocs=1, join=False, start_method="fork")
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish in 1 s"):
        join_or_fail(ranks, 1)
    assert time.monotonic() - started < 30 and not ranks.processes[0].is_alive()


@pytest.fixture(scope="module")
def ddp_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    # One start for every case; forked, not spawned: a spawned rank imports torch and this module
    # again (~6 s of CPU of the test's 15). Each rank seeds itself and builds its own model.
    ranks = mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=False, start_method="fork")
    join_or_fail(ranks, JOIN_TIMEOUT_S)
    return {rates: [torch.load(out / f"{rates}{r}.pt") for r in range(2)] for rates in RATES}


@pytest.mark.parametrize("rates", RATES)
def test_two_ranks_match_one_process(rates, ddp_records):
    ranks = ddp_records[rates]
    single = train(make_model(rates), global_batches())
    skipped_any = False
    for step in range(STEPS):
        assert ranks[0][step]["kept"] == ranks[1][step]["kept"] == single[step]["kept"]
        skipped_any |= len(single[step]["kept"][0]) < 4 or len(single[step]["kept"][1]) < 4
        for r in range(2):
            torch.testing.assert_close(ranks[r][step]["grads"], single[step]["grads"], rtol=1e-4, atol=1e-6)
    assert skipped_any or CASES[rates][0] == 0  # otherwise DDP's unused-parameter failure could not show
