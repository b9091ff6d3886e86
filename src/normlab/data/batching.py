"""Token-budget batches of similar-length pairs (as fairseq's batch_by_size), sharded for DDP."""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Sampler


class TranslationDataset(Dataset):
    """Token-id pairs of one split; item = (index in the split, src ids, tgt ids).

    `indices` maps positions back to the split's line numbers when some pairs were filtered
    out, so `idx` in a batch always addresses the split's references."""

    def __init__(self, src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]],
                 indices: Sequence[int] | None = None):
        if len(src_ids) != len(tgt_ids):
            raise ValueError(f"{len(src_ids)} source vs {len(tgt_ids)} target sequences")
        self.src, self.tgt = src_ids, tgt_ids
        self.indices = list(range(len(src_ids))) if indices is None else list(indices)
        # Padded lengths as collate builds them: source + EOS, BOS + target.
        self.src_sizes = torch.tensor([len(s) + 1 for s in src_ids], dtype=torch.long)
        self.tgt_sizes = torch.tensor([len(t) + 1 for t in tgt_ids], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> tuple[int, Sequence[int], Sequence[int]]:
        return self.indices[i], self.src[i], self.tgt[i]


def _generator(*parts: int) -> torch.Generator:
    # sha256, not hash(): stable across processes and Python versions; distinct (seed, epoch)
    # pairs never share a stream the way seed * K + epoch could.
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def batch_by_size(src_sizes: torch.Tensor, tgt_sizes: torch.Tensor, max_tokens: int,
                  order: torch.Tensor) -> list[list[int]]:
    """Greedy: walk `order`, close a batch when n_sentences x longest (either side) would
    exceed max_tokens. The cost counts padding, which is what memory and compute pay for."""
    src, tgt = src_sizes.tolist(), tgt_sizes.tolist()
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order.tolist():
        size = max(src[i], tgt[i])
        if size > max_tokens:
            raise ValueError(f"pair {i} needs {size} tokens per row, more than max_tokens="
                             f"{max_tokens}; raise max_tokens or lower max_positions")
        if cur and (len(cur) + 1) * max(longest, size) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, size)
    if cur:
        batches.append(cur)
    return batches


class TokenBatchSampler(Sampler[list[int]]):
    """Yields lists of dataset positions.

    Batches are built once, from pairs sorted by (source, target) length; with shuffle, ties
    are broken by a permutation seeded from `seed` (otherwise neighbouring verses of the same
    length would always share a batch) and the order of batches is reshuffled every epoch
    from (seed, epoch). Under DDP every rank draws the same order and takes every
    num_replicas-th batch; the list is padded by repeating batches from its start so each rank
    gets exactly len(self) batches (an unequal count would hang the gradient all-reduce).
    With num_replicas > 1, evaluation must therefore de-duplicate by `idx`."""

    def __init__(self, src_sizes: torch.Tensor, tgt_sizes: torch.Tensor, max_tokens: int,
                 shuffle: bool = True, seed: int = 1, num_replicas: int = 1, rank: int = 0,
                 epoch_fn: Callable[[], int | None] | None = None):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        self.shuffle, self.seed = shuffle, seed
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        # Lightning calls set_epoch only on samplers, not on batch samplers, so the data module
        # passes a function that reads trainer.current_epoch; it wins over set_epoch when set.
        self.epoch_fn = epoch_fn
        order = torch.arange(len(src_sizes))
        if shuffle:
            order = torch.randperm(len(src_sizes), generator=_generator(seed))
        # Two stable sorts = lexicographic (source, target) length order, as fairseq.
        order = order[torch.sort(tgt_sizes[order], stable=True).indices]
        order = order[torch.sort(src_sizes[order], stable=True).indices]
        self.batches = batch_by_size(src_sizes, tgt_sizes, max_tokens, order)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def current_epoch(self) -> int:
        epoch = self.epoch_fn() if self.epoch_fn is not None else None
        return self.epoch if epoch is None else epoch

    def __len__(self) -> int:
        return math.ceil(len(self.batches) / self.num_replicas)

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.batches)
        if self.shuffle:
            order = torch.randperm(n, generator=_generator(self.seed, self.current_epoch())).tolist()
        else:
            order = list(range(n))
        total = len(self) * self.num_replicas
        order = (order * math.ceil(total / n))[:total] if n else []
        for j in range(self.rank, total, self.num_replicas):
            yield list(self.batches[order[j]])


def collate(samples: Sequence[tuple[int, Sequence[int], Sequence[int]]], pad_id: int,
            bos_id: int, eos_id: int) -> dict:
    """src = x + EOS; tgt_in = BOS + y (teacher forcing input); tgt_out = y + EOS (labels).
    All right-padded with pad_id. ntokens counts the non-pad labels (the loss normaliser)."""
    B = len(samples)
    src_len = [len(s) + 1 for _, s, _ in samples]
    tgt_len = [len(t) + 1 for _, _, t in samples]
    src = torch.full((B, max(src_len)), pad_id, dtype=torch.long)  # (B, S)
    tgt_in = torch.full((B, max(tgt_len)), pad_id, dtype=torch.long)  # (B, T)
    tgt_out = torch.full((B, max(tgt_len)), pad_id, dtype=torch.long)  # (B, T)
    for b, (_, s, t) in enumerate(samples):
        n, m = len(s), len(t)
        t = torch.as_tensor(t, dtype=torch.long)
        src[b, :n] = torch.as_tensor(s, dtype=torch.long)
        src[b, n] = eos_id
        tgt_in[b, 0] = bos_id
        tgt_in[b, 1:m + 1] = t
        tgt_out[b, :m] = t
        tgt_out[b, m] = eos_id
    return {
        "src": src,
        "tgt_in": tgt_in,
        "tgt_out": tgt_out,
        "idx": torch.tensor([i for i, _, _ in samples], dtype=torch.long),
        "ntokens": sum(tgt_len),
    }
