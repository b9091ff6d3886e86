"""One side of a corpus as flat arrays: every sentence's token ids back to back, with offsets and
lengths (fairseq's MMapIndexedDataset idea). On disk they are raw little-endian arrays that the
manifest describes (dtype, count, bytes); in a run they are memory maps, so DDP ranks share the
page cache and a process touches only the pages of the batches it builds."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

KINDS = ("tokens", "offsets", "lengths")


def release_freed_memory() -> None:
    """Hand the heap pages freed by large numpy temporaries back to the OS (glibc's malloc_trim).
    Building a split's sizes and batch order at 4M pairs frees ~100 MB of temporaries that glibc
    otherwise keeps (its mmap threshold grows after the first large free), which measured as +300 MB
    of resident memory at the first step instead of +100 MB (benchmarks/data_pipeline.py)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def length_dtype(max_length: int) -> np.dtype:
    return np.dtype("<u2") if max_length < 1 << 16 else np.dtype("<i4")


def array_spec(a: np.ndarray) -> dict:
    return {"dtype": a.dtype.str, "count": int(a.size), "bytes": int(a.nbytes)}


class TokenArray:
    """tokens (total,), offsets (n + 1,) int64, lengths (n,): sentence i is
    tokens[offsets[i]:offsets[i] + lengths[i]]."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, files: dict | None = None):
        if len(offsets) != len(lengths) + 1:
            raise ValueError(f"{len(offsets)} offsets for {len(lengths)} lengths")
        self.tokens, self.offsets, self.lengths = tokens, offsets, lengths
        self._files = files  # {kind: (path, spec)} when memory-mapped: pickles by path, not by value

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int]], dtype: np.dtype = np.dtype("<i4")) -> "TokenArray":
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.fromiter((t for s in seqs for t in s), dtype=dtype, count=int(offsets[-1]))
        return cls(tokens, offsets, lengths)

    @classmethod
    def open(cls, files: dict[str, tuple[Path, dict]]) -> "TokenArray":
        """Memory-map files {kind: (path, spec)} whose sizes were checked against their specs."""
        arrays = {}
        for kind, (path, spec) in files.items():
            dtype = np.dtype(spec["dtype"])
            arrays[kind] = (np.memmap(path, dtype=dtype, mode="r", shape=(spec["count"],))
                            if spec["count"] else np.zeros(0, dtype=dtype))
        # Batches read scattered sentences: without MADV_RANDOM every page fault reads ahead ~128 KB
        # around it, and a 4M-pair run's resident memory grew by ~400 MB of page cache in 20 steps
        # that it never reads (benchmarks/data_pipeline.py). Lengths are read whole: readahead helps.
        from normlab.private_api import numpy_mmap  # (torch: not at import, the preprocess command is torch-free)

        for kind in ("tokens", "offsets"):
            mm = numpy_mmap(arrays[kind])
            if mm is not None and hasattr(mmap, "MADV_RANDOM"):
                mm.madvise(mmap.MADV_RANDOM)
        return cls(arrays["tokens"], arrays["offsets"], arrays["lengths"], files)

    def __reduce__(self):
        if self._files is not None:  # DataLoader workers re-open the maps instead of copying them
            return TokenArray.open, (self._files,)
        return TokenArray, (self.tokens, self.offsets, self.lengths)

    def __getitem__(self, i: int) -> list[int]:
        start = int(self.offsets[i])
        return self.tokens[start:start + int(self.lengths[i])].tolist()

    def gather(self, rows: np.ndarray, limit: int | None, pad: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids (B, L) int64 right-padded with `pad`, lengths (B,)) of sentences `rows`, each cut
        to `limit` tokens; one vectorised read from the memory map."""
        lengths = self.lengths[rows].astype(np.int64)
        if limit is not None:
            np.minimum(lengths, limit, out=lengths)
        width = int(lengths.max()) if len(rows) else 0
        cols = np.arange(width)
        mask = cols < lengths[:, None]  # (B, L)
        ids = np.full((len(rows), width), pad, dtype=np.int64)
        ids[mask] = self.tokens[(self.offsets[rows][:, None] + cols)[mask]]
        return ids, lengths


class ArrayWriter:
    """Appends token chunks of one side to <prefix>.tokens and collects lengths; `close` writes
    <prefix>.offsets and <prefix>.lengths and returns the three specs for the manifest."""

    def __init__(self, prefix: Path, dtype: np.dtype):
        self.prefix, self.dtype = prefix, dtype
        self.file = open(f"{prefix}.tokens", "wb")
        self._lengths: list[np.ndarray] = []
        self.count = 0

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(lengths)
        self.count += int(tokens.size)

    def close(self) -> dict[str, dict]:
        _sync_close(self.file)
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype="<i8")
        np.cumsum(lengths, out=offsets[1:])
        lengths = lengths.astype(length_dtype(int(lengths.max(initial=0))))
        specs = {"tokens": {"dtype": self.dtype.str, "count": self.count, "bytes": self.count * self.dtype.itemsize}}
        for kind, a in (("offsets", offsets), ("lengths", lengths)):
            with open(f"{self.prefix}.{kind}", "wb") as f:
                f.write(a.tobytes())
                _sync_close(f)
            specs[kind] = array_spec(a)
        return specs


def _sync_close(f) -> None:
    # Durable before the folder is renamed into place: a crash must not leave a complete-looking
    # folder whose arrays are still in the page cache only.
    f.flush()
    os.fsync(f.fileno())
    f.close()
