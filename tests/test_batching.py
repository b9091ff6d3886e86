"""Token-budget batch sampler and collate: coverage, budget, epoch order, DDP shards, padding."""
import torch

from normlab.data.batching import TokenBatchSampler, TranslationDataset, collate

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
    n = len(full.batches)
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


def test_collate_values():
    samples = [(7, [10, 11, 12], [20, 21]), (3, [13], [22, 23, 24, 25])]
    b = collate(samples, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    assert b["src"].tolist() == [[10, 11, 12, EOS], [13, EOS, PAD, PAD]]
    assert b["tgt_out"].tolist() == [[20, 21, EOS, PAD, PAD], [22, 23, 24, 25, EOS]]
    assert b["tgt_in"].tolist() == [[BOS, 20, 21, PAD, PAD], [BOS, 22, 23, 24, 25]]
    assert b["idx"].tolist() == [7, 3] and b["idx"].dtype == torch.long
    assert b["ntokens"] == 3 + 5 == int((b["tgt_out"] != PAD).sum())
    # Teacher forcing: tgt_in is tgt_out shifted right by one, BOS in front.
    mask = b["tgt_in"] != PAD
    assert torch.equal(b["tgt_in"][:, 1:][mask[:, 1:]], b["tgt_out"][:, :-1][mask[:, 1:]])


def test_dataset_sizes_and_indices():
    ds = TranslationDataset([[5, 6], [7]], [[8], [9, 9, 9]], indices=[4, 9])
    assert ds.src_sizes.tolist() == [3, 2] and ds.tgt_sizes.tolist() == [2, 4]
    assert ds[1] == (9, [7], [9, 9, 9])
    s = TokenBatchSampler(ds.src_sizes, ds.tgt_sizes, max_tokens=8, shuffle=False)
    b = collate([ds[i] for i in next(iter(s))], PAD, BOS, EOS)
    assert b["src"].numel() <= 8 and b["tgt_out"].numel() <= 8
