"""Read and validate line-aligned parallel text; every error names the file and the line.

Two readers with one set of rules: `read_lines` for small files read whole (translate, evaluate
--src), and `LineReader` + `scan` for corpora of any size, streamed in blocks (preprocess).
Lines end at "\\n" only (a trailing "\\r" is dropped), a UTF-8 byte order mark at the start of a
file is dropped, and gzip is detected by content, not by suffix.
"""
from __future__ import annotations

import gzip
import hashlib
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from normlab.errors import UserError

log = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"
_BOM = "\ufeff"
_BLOCK = 1 << 20


class CorpusError(UserError, ValueError):
    """A corpus file or data folder is missing, misaligned, empty, stale or not UTF-8 (the message
    starts with the file, and its line where there is one)."""


def check_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"{path}: is a directory, not a corpus file")
    if not path.is_file():
        raise CorpusError(f"{path}: corpus file not found")
    return path


def is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == _GZIP_MAGIC


def _utf8_error(path: Path, e: UnicodeDecodeError, first_line: int, file_offset: int) -> CorpusError:
    """`e` from decoding bytes that start at `first_line` and at `file_offset` of the file."""
    line = first_line + e.object.count(b"\n", 0, e.start)
    col = e.start - (e.object.rfind(b"\n", 0, e.start) + 1)
    gz = ", after gunzip" if is_gzip(path) else ""
    return CorpusError(f"{path}:{line}: invalid UTF-8 byte 0x{e.object[e.start]:02x} at byte offset "
                       f"{file_offset + e.start} (byte {col} of the line{gz})")


def read_lines(path: str | Path) -> list[str]:
    """All lines of a plain or gzip file, without line ends."""
    path = check_file(path)
    data = path.read_bytes()
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise CorpusError(f"{path}: corrupt gzip file ({e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _utf8_error(path, e, 1, 0) from None
    if not text:
        return []
    text = text.removeprefix(_BOM).removesuffix("\n")
    # split("\n"), not splitlines(): splitlines also breaks at U+2028, U+0085, \x0c ... which
    # would silently shift one side of a parallel corpus against the other.
    return [line.removesuffix("\r") for line in text.split("\n")]


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str], dict]:
    """Aligned (source, target) lines of small files; pairs with an empty side are dropped and counted."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    check_aligned(src_path, len(src), tgt_path, len(tgt))
    keep = [i for i, (s, t) in enumerate(zip(src, tgt)) if s.strip() and t.strip()]
    stats = {"lines": len(src), "dropped_empty": len(src) - len(keep), "pairs": len(keep)}
    check_pairs(src_path, tgt_path, stats)
    return [src[i].strip() for i in keep], [tgt[i].strip() for i in keep], stats


def check_aligned(src_path, n_src: int, tgt_path, n_tgt: int) -> None:
    if n_src != n_tgt:
        raise CorpusError(f"line counts differ: {src_path} has {n_src} lines, {tgt_path} has {n_tgt}")
    if not n_src:
        raise CorpusError(f"empty corpus: {src_path} and {tgt_path} have no lines")


def check_pairs(src_path, tgt_path, stats: dict) -> None:
    if not stats["pairs"]:
        raise CorpusError(f"empty corpus: every line pair of {src_path} / {tgt_path} has an empty side")
    if stats["dropped_empty"]:
        log.warning("%s / %s: dropped %d of %d pairs with an empty side",
                    src_path, tgt_path, stats["dropped_empty"], stats["lines"])


# -- streaming ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileInfo:
    path: str
    size: int
    mtime_ns: int
    sha256: str
    lines: int

    def identity(self) -> dict:
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns, "sha256": self.sha256}


def open_binary(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")


def _gzip_error(path: Path, e: Exception) -> CorpusError:
    return CorpusError(f"{path}: corrupt gzip file ({e})")


def scan(path: str | Path) -> FileInfo:
    """One pass over the file: its sha256 (of the bytes on disk) and its number of lines."""
    path = check_file(path)
    st = path.stat()
    sha, count, last, gz = hashlib.sha256(), 0, b"\n", is_gzip(path)
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gz else None
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            sha.update(block)
            if inflate is not None:
                try:
                    out = inflate.decompress(block)
                    while inflate.eof and inflate.unused_data:  # a multi-member gzip file
                        rest = inflate.unused_data
                        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
                        out += inflate.decompress(rest)
                except zlib.error as e:
                    raise _gzip_error(path, e) from None
                block = out
            if block:
                if (nul := block.find(b"\0")) >= 0:  # text never holds one; a binary file (a tensor,
                    # an archive) would otherwise be reported as "line counts differ"
                    line = count + block.count(b"\n", 0, nul) + 1
                    raise CorpusError(f"{path}:{line}: a NUL byte: not a text corpus (a binary file?)")
                count += block.count(b"\n")
                last = block[-1:]
    if inflate is not None and not inflate.eof:
        raise _gzip_error(path, EOFError("compressed file ended before the end-of-stream marker"))
    return FileInfo(str(path.resolve()), st.st_size, st.st_mtime_ns, sha.hexdigest(), count + (last != b"\n"))


class LineReader:
    """Raw lines (bytes, without "\\n") of a plain or gzip file, `take(n)` at a time, with the
    line number and byte offset of the first one, so a later decode error names file:line."""

    def __init__(self, path: str | Path):
        self.path = check_file(path)
        self._f = open_binary(self.path)
        self._lines: list[bytes] = []
        self._pos = 0
        self._partial = b""
        self._eof = False
        self.line = 1  # number of the next line
        self.offset = 0  # byte offset (after gunzip) of the next line

    def _fill(self) -> None:
        try:
            block = self._f.read(_BLOCK)
        except (OSError, EOFError, zlib.error) as e:
            raise _gzip_error(self.path, e) from None
        if not block:
            self._eof = True
            if self._partial:
                self._lines, self._pos = self._lines[self._pos:] + [self._partial], 0
                self._partial = b""
            return
        parts = (self._partial + block).split(b"\n")
        self._partial = parts.pop()
        self._lines, self._pos = self._lines[self._pos:] + parts, 0

    def take(self, n: int) -> tuple[int, int, list[bytes]]:
        """(first line number, its byte offset, up to n lines); fewer only at the end of the file."""
        first, offset = self.line, self.offset
        while len(self._lines) - self._pos < n and not self._eof:
            self._fill()
        out = self._lines[self._pos:self._pos + n]
        self._pos += len(out)
        self.line += len(out)
        self.offset += sum(map(len, out)) + len(out)
        return first, offset, out

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "LineReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def decode_lines(raw: list[bytes], path: str | Path, first_line: int, offset: int) -> list[str]:
    """UTF-8 text of raw lines as read_lines returns them (BOM of line 1 and trailing "\\r" dropped)."""
    try:
        text = b"\n".join(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _utf8_error(Path(path), e, first_line, offset) from None
    lines = text.split("\n") if raw else []
    if first_line == 1 and lines:
        lines[0] = lines[0].removeprefix(_BOM)
    return [line.removesuffix("\r") for line in lines]
