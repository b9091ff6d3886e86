"""Token-budget batch sampler and collate: coverage, budget, epoch order, DDP shards, padding,
mid-epoch resumption."""
import numpy as np
import pytest
import torch

from normlab.data.arrays import TokenArray
from normlab.data.batching import BatchLoader, PairDataset, TokenBatchSampler, batch_by_size, length_order

PAD, BOS, EOS = 0, 1, 2


def toy_sizes(n=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(2, 60, (n,), generator=g)
    tgt = (src + torch.randint(-5, 6, (n,), generator=g)).clamp(min=2)
    return src, tgt


def cost(batch, src, tgt):
    return len(batch) * max(src[batch].max().item(), tgt[batch].max().item())


def test_every_index_once_and_budget_respected():
    src, tgt = toy_sizes()
    s = TokenBatchSampler(src, tgt, max_tokens=256, seed=3)
    batches = list(s)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(src)))
    assert len(batches) == len(s)
    assert max(cost(b, src, tgt) for b in batches) <= 256
    # Greedy packing is tight: adding the next sorted pair would have crossed the budget, so
    # batches are not trivially small (mean fill well above half the budget).
    assert sum(cost(b, src, tgt) for b in batches) / len(batches) > 0.75 * 256


def test_batches_group_similar_lengths():
    src, tgt = toy_sizes()
    s = TokenBatchSampler(src, tgt, max_tokens=256, shuffle=False)
    batches = list(s)
    # Sorted by source length: each batch's lengths lie between its neighbours'.
    for a, b in zip(batches, batches[1:]):
        assert src[a].max() <= src[b].min()


def test_epoch_order_changes_and_is_reproducible():
    src, tgt = toy_sizes()
    a = TokenBatchSampler(src, tgt, max_tokens=256, seed=7)
    b = TokenBatchSampler(src, tgt, max_tokens=256, seed=7)
    a.set_epoch(1)
    b.set_epoch(1)
    e1 = list(a)
    assert e1 == list(b)  # same seed + epoch
    a.set_epoch(2)
    assert list(a) != e1
    assert sorted(map(sorted, list(a))) == sorted(map(sorted, e1))  # same batches, new order
    c = TokenBatchSampler(src, tgt, max_tokens=256, seed=8)
    c.set_epoch(1)
    assert list(c) != e1


def test_epoch_fn_overrides_set_epoch():
    src, tgt = toy_sizes()
    epoch = {"now": 4}
    a = TokenBatchSampler(src, tgt, max_tokens=256, epoch_fn=lambda: epoch["now"])
    b = TokenBatchSampler(src, tgt, max_tokens=256)
    b.set_epoch(4)
    assert list(a) == list(b)
    epoch["now"] = 5
    b.set_epoch(5)
    assert list(a) == list(b)


def test_eval_order_is_sorted_and_fixed():
    src, tgt = toy_sizes()
    s = TokenBatchSampler(src, tgt, max_tokens=256, shuffle=False)
    first = list(s)
    s.set_epoch(3)
    assert list(s) == first
    lengths = [src[b].max().item() for b in first]
    assert lengths == sorted(lengths)


def test_ddp_shards_disjoint_and_equal():
    src, tgt = toy_sizes()
    full = TokenBatchSampler(src, tgt, max_tokens=256, seed=1)
    n = full.num_batches
    for replicas in (2, 3):
        shards = [list(TokenBatchSampler(src, tgt, 256, seed=1, num_replicas=replicas, rank=r))
                  for r in range(replicas)]
        assert len({len(sh) for sh in shards}) == 1
        assert len(shards[0]) == -(-n // replicas)
        seen = [i for sh in shards for b in sh for i in b]
        assert set(seen) == set(range(len(src)))
        padded = len(shards[0]) * replicas - n  # batches repeated so that every rank has as many
        repeated = sorted(map(sorted, [b for sh in shards for b in sh]))
        distinct = {tuple(b) for b in repeated}
        assert len(distinct) == n and len(repeated) - len(distinct) == padded
        if padded == 0:
            assert len(seen) == len(set(seen))  # disjoint


def test_more_replicas_than_batches_still_equal():
    src, tgt = torch.tensor([3, 3, 3]), torch.tensor([3, 3, 3])
    shards = [list(TokenBatchSampler(src, tgt, 100, num_replicas=4, rank=r)) for r in range(4)]
    assert [len(s) for s in shards] == [1, 1, 1, 1]


def pairs(src, tgt, rows=None, limit=None):
    return PairDataset(TokenArray.from_sequences(src), TokenArray.from_sequences(tgt), rows, limit)


def test_collate_values():
    ds = pairs([[0], [0], [13], [0], [10, 11, 12]], [[0], [0], [22, 23, 24, 25], [0], [20, 21]])
    b = ds.__getitems__([4, 2])  # what DataLoader calls with a batch of dataset positions
    assert b["src"].tolist() == [[10, 11, 12, EOS], [13, EOS, PAD, PAD]]
    assert b["tgt_out"].tolist() == [[20, 21, EOS, PAD, PAD], [22, 23, 24, 25, EOS]]
    assert b["tgt_in"].tolist() == [[BOS, 20, 21, PAD, PAD], [BOS, 22, 23, 24, 25]]
    assert b["idx"].tolist() == [4, 2] and b["idx"].dtype == torch.long and b["src"].dtype == torch.long
    assert b["ntokens"] == 3 + 5 == int((b["tgt_out"] != PAD).sum())
    # Teacher forcing: tgt_in is tgt_out shifted right by one, BOS in front.
    mask = b["tgt_in"] != PAD
    assert torch.equal(b["tgt_in"][:, 1:][mask[:, 1:]], b["tgt_out"][:, :-1][mask[:, 1:]])
    assert ds[4] == (4, [10, 11, 12], [20, 21])


def test_rows_limit_and_source_only_batches():
    ds = pairs([[5, 6], [7], [1, 2, 3, 4]], [[8], [9, 9, 9], [6, 6]], rows=[2, 1], limit=3)
    assert ds.src_sizes.tolist() == [4, 2] and ds.tgt_sizes.tolist() == [3, 4]
    assert ds[0] == (2, [1, 2, 3], [6, 6])  # cut to the limit; idx is the pair's row
    b = ds.__getitems__([0, 1])
    assert b["idx"].tolist() == [2, 1] and b["src"].tolist() == [[1, 2, 3, EOS], [7, EOS, PAD, PAD]]
    src_only = ds.head(1, sources_only=True)
    assert src_only.tgt_sizes.tolist() == [1]
    b = src_only.__getitems__([0])
    assert b["tgt_in"].tolist() == [[BOS]] and b["tgt_out"].tolist() == [[EOS]] and b["ntokens"] == 1


def greedy_reference(src, tgt, max_tokens, order):
    """The per-pair loop batch_by_size replaced (fairseq's batch_by_size semantics)."""
    batches, cur, longest = [], [], 0
    for i in order.tolist():
        size = max(int(src[i]), int(tgt[i]))
        if cur and (len(cur) + 1) * max(longest, size) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, size)
    return batches + ([cur] if cur else [])


@pytest.mark.parametrize("max_tokens", [70, 256, 4096])
def test_vectorised_greedy_equals_the_per_pair_loop(max_tokens):
    src, tgt = (x.numpy() for x in toy_sizes(2000, seed=max_tokens))
    order = np.random.default_rng(0).permutation(len(src))
    bounds = batch_by_size(src, tgt, max_tokens, order)
    assert [order[a:b].tolist() for a, b in zip(bounds, bounds[1:])] == greedy_reference(src, tgt, max_tokens, order)


@pytest.mark.parametrize("big", [False, True])
def test_length_order_is_lexicographic_and_stable(big):
    src, tgt = (x.numpy() for x in toy_sizes(3000, seed=5))
    if big:  # sizes past uint16 take the lexsort path
        src = src * 2000
    order = np.random.default_rng(1).permutation(len(src))
    got = length_order(src, tgt, order)
    rank = {int(i): r for r, i in enumerate(order)}
    assert [int(i) for i in got] == sorted(order.tolist(), key=lambda i: (src[i], tgt[i], rank[i]))


def test_a_pair_over_the_budget_is_named():
    with pytest.raises(ValueError, match="max_tokens=10 is less than the 12 tokens of pair 1"):
        batch_by_size(np.array([3, 12]), np.array([3, 4]), 10, np.arange(2))


@pytest.mark.parametrize("replicas", [1, 3])
def test_resume_mid_epoch_yields_the_rest(replicas):
    src, tgt = toy_sizes()
    for rank in range(replicas):
        make = lambda: TokenBatchSampler(src, tgt, 256, seed=4, num_replicas=replicas, rank=rank)
        full = make()
        full.set_epoch(2)
        whole = list(full)
        assert full.state_dict() == {"epoch": 2, "position": len(whole)}
        for k in (0, 1, len(whole) // 2, len(whole)):
            first = make()
            first.set_epoch(2)
            it = iter(first)
            head = [next(it) for _ in range(k)]
            state = first.state_dict()
            assert state == {"epoch": 2, "position": k}
            resumed = make()
            resumed.load_state_dict(state)
            resumed.set_epoch(2)
            assert head + list(resumed) == whole
            assert list(resumed) == whole  # the restored position applies to one iteration only
        other = make()
        other.load_state_dict({"epoch": 1, "position": 5})  # a finished epoch's state: epoch 2 starts afresh
        other.set_epoch(2)
        assert list(other) == whole


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_state_counts_delivered_batches(workers):
    """Worker processes draw batches ahead of the training loop; the saved position must be the
    loop's, or a resumed run would skip the prefetched batches."""
    src = [[5] * (1 + i % 7) for i in range(300)]
    ds = pairs(src, src)
    make = lambda: BatchLoader(ds, TokenBatchSampler(ds.src_sizes, ds.tgt_sizes, 24, seed=2), num_workers=workers)
    whole = [b["idx"].tolist() for b in make()]
    loader = make()
    it = iter(loader)
    head = [next(it)["idx"].tolist() for _ in range(5)]
    state = loader.state_dict()
    assert state == {"epoch": 0, "position": 5}
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [b["idx"].tolist() for b in resumed] == whole


def test_a_state_saved_after_the_epochs_last_batch_resumes_with_the_next_epoch():
    """Lightning goes on with epoch e + 1 but creates the iterator while current_epoch is still e."""
    src = [[5] * (1 + i % 7) for i in range(300)]
    ds = pairs(src, src)
    epoch = {"now": 0}
    make = lambda: BatchLoader(ds, TokenBatchSampler(ds.src_sizes, ds.tgt_sizes, 24, seed=2,
                                                     epoch_fn=lambda: epoch["now"]))
    epoch["now"] = 1
    second_epoch = [b["idx"].tolist() for b in make()]
    epoch["now"] = 0
    resumed = make()
    resumed.load_state_dict({"epoch": 0, "position": len(resumed.batch_sampler)})
    assert [b["idx"].tolist() for b in resumed] == second_epoch
    assert resumed.state_dict()["epoch"] == 1


def test_what_a_run_keeps_per_training_pair_is_a_few_bytes():
    # Memory must not grow much with the corpus: per pair, the dataset keeps its row (int32) and two
    # sizes (uint16), the sampler its place in the length order (int32): 12 bytes, 48 MB at 4M pairs.
    n = 50_000
    lengths = np.random.default_rng(0).integers(1, 60, n)
    side = TokenArray(np.zeros(int(lengths.sum()), np.uint16), np.concatenate([[0], np.cumsum(lengths)]),
                      lengths.astype(np.uint16))
    ds = PairDataset(side, side)
    sampler = TokenBatchSampler(ds.src_sizes, ds.tgt_sizes, 2048, seed=3)
    kept = ds.rows.nbytes + ds.src_sizes.nbytes + ds.tgt_sizes.nbytes + sampler.order.nbytes
    assert kept / n == 12
    # the int32 order is the same permutation the int64 one was (the bundled-corpus fingerprints in
    # test_data_equivalence.py pin the batches themselves)
    order64 = length_order(ds.src_sizes.astype(np.int64), ds.tgt_sizes.astype(np.int64),
                           torch.randperm(n, generator=torch.Generator().manual_seed(0)).numpy())
    order32 = length_order(ds.src_sizes, ds.tgt_sizes,
                           torch.randperm(n, generator=torch.Generator().manual_seed(0), dtype=torch.int32).numpy())
    assert np.array_equal(order64, order32)
