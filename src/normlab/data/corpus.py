"""Read and validate line-aligned parallel text; every error names the file and the line."""
from __future__ import annotations

import gzip
import logging
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"


class CorpusError(ValueError):
    """A corpus file is missing, misaligned, empty or not UTF-8."""


def read_lines(path: str | Path) -> list[str]:
    """All lines of a plain or gzip file (detected by content, not suffix), without line ends."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: corpus file not found")
    data = path.read_bytes()
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise CorpusError(f"{path}: corrupt gzip file ({e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1)
        raise CorpusError(
            f"{path}:{line}: invalid UTF-8 byte 0x{data[e.start]:02x} at byte offset {e.start} "
            f"(byte {col} of the line{', after gunzip' if path.suffix == '.gz' else ''})"
        ) from None
    if text.endswith("\n"):
        text = text[:-1]
    if not text:
        return []
    # split("\n"), not splitlines(): splitlines also breaks at U+2028, U+0085, \x0c ... which
    # would silently shift one side of a parallel corpus against the other.
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str], dict]:
    """Aligned (source, target) lines; pairs with an empty side are dropped and counted."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise CorpusError(
            f"line counts differ: {src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}"
        )
    if not src:
        raise CorpusError(f"empty corpus: {src_path} and {tgt_path} have no lines")
    keep = [i for i, (s, t) in enumerate(zip(src, tgt)) if s.strip() and t.strip()]
    stats = {"lines": len(src), "dropped_empty": len(src) - len(keep), "pairs": len(keep)}
    if not keep:
        raise CorpusError(f"empty corpus: every line pair of {src_path} / {tgt_path} has an empty side")
    if stats["dropped_empty"]:
        log.warning("%s / %s: dropped %d of %d pairs with an empty side",
                    src_path, tgt_path, stats["dropped_empty"], len(src))
    return [src[i].strip() for i in keep], [tgt[i].strip() for i in keep], stats


def fits(n_tokens: int, max_positions: int) -> bool:
    # +1: collate appends EOS to the source and prepends BOS to the target input.
    return n_tokens + 1 <= max_positions


def filter_by_length(
    src_ids: Sequence[Sequence[int]],
    tgt_ids: Sequence[Sequence[int]],
    max_positions: int,
    name: str = "corpus",
) -> tuple[list[int], int]:
    """Indices of the pairs whose both sides fit in max_positions, and how many were dropped."""
    keep = [i for i, (s, t) in enumerate(zip(src_ids, tgt_ids))
            if fits(len(s), max_positions) and fits(len(t), max_positions)]
    dropped = len(src_ids) - len(keep)
    if dropped:
        log.warning("%s: dropped %d of %d pairs longer than max_positions=%d (incl. EOS/BOS)",
                    name, dropped, len(src_ids), max_positions)
    return keep, dropped


def truncate(ids: Sequence[Sequence[int]], max_positions: int) -> tuple[list[list[int]], int]:
    """Cut every sequence to max_positions - 1 tokens (room for EOS/BOS); returns the count cut."""
    limit = max_positions - 1
    out = [list(x[:limit]) for x in ids]
    return out, sum(len(x) > limit for x in ids)
