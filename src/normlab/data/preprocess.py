"""Parallel text -> a data folder of memory-mappable token arrays (fairseq-preprocess's job).

    scan inputs (line counts, checksums; misaligned files fail here, before any work)
    -> sentencepiece on a bounded, seeded sample of the training lines (or a given model)
    -> encode chunks of pairs in worker processes, appending to the arrays in order
    -> manifest.json, then one rename: the folder appears complete or not at all.

The folder (format in docs/data.md, "Large corpora"): spm.model; {split}.{src,tgt}.{tokens,offsets,
lengths} raw little-endian arrays; {valid,test}.{src,tgt}.txt, the stripped text that BLEU and
the decoding commands read; manifest.json (inputs with sizes, mtimes and sha256, settings, counts,
dropped pairs by reason, the arrays' dtypes and byte sizes, the command that wrote it).
Pairs with an empty side are dropped here; length limits depend on the model and are applied
when a run loads the arrays.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm import tqdm

from normlab.data.arrays import ArrayWriter, token_dtype
from normlab.data.corpus import CorpusError, LineReader, check_aligned, check_pairs, decode_lines, scan
from normlab.data.tokenizer import MODEL_FILE, Tokenizer
from normlab.file_mode import creation_mode

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "valid", "test")
SIDES = ("src", "tgt")
CHUNK = 10_000  # pairs per encoding task: small enough for a smooth progress bar, large enough to amortise IPC


@dataclass(frozen=True)
class SpmSettings:
    vocab_size: int = 8000
    model_type: str = "bpe"
    character_coverage: float = 1.0
    sample: int = 1_000_000  # at most this many training lines (source + target) train sentencepiece; 0 = all
    seed: int = 1  # draws the sample


def preprocess(files: dict[str, tuple[str | Path, str | Path]], out: str | Path, spm: SpmSettings | None = None,
               tokenizer: Tokenizer | None = None, workers: int = 1, progress: bool = False,
               command: str | None = None, name: str | None = None, src_lang: str = "src", tgt_lang: str = "tgt",
               force: bool = False, own_cache: bool = False) -> dict:
    """Write the data folder `out` from {split: (source file, target file)}; returns its manifest.
    `tokenizer` given: used as is; else one is trained with `spm`. `force` replaces `out` only if it
    is a normlab data folder (its manifest says so) or empty (`own_cache`: a folder of normlab's own
    cache), never a folder that holds an input file."""
    out = Path(out)
    name = name or out.name
    if out.exists() and not force:
        raise CorpusError(f"{out}: exists (pass --force to replace it)")
    if out.exists():
        check_replaceable(out, [p for pair in files.values() for p in pair], own_cache)
    t0 = time.perf_counter()
    infos = {(split, side): scan(files[split][i]) for split in SPLITS for i, side in enumerate(SIDES)}
    for split in SPLITS:
        check_aligned(files[split][0], infos[split, "src"].lines, files[split][1], infos[split, "tgt"].lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, creation_mode(folder=True))  # mkdtemp's 0700 would keep the folder from the user's group
    try:
        t1 = time.perf_counter()
        spm = spm or SpmSettings()
        sample_lines = None
        if tokenizer is None:
            lines = sample_training_lines(files["train"], (infos["train", "src"].lines, infos["train", "tgt"].lines),
                                          spm.sample, spm.seed)
            sample_lines = len(lines)
            if not lines:
                raise CorpusError(f"empty corpus: every line pair of {files['train'][0]} / {files['train'][1]} "
                                  "has an empty side (no text to learn a vocabulary from)")
            try:
                tokenizer = Tokenizer.train(lines, spm.vocab_size, spm.model_type, spm.character_coverage, spm.seed)
            except RuntimeError as e:  # e.g. a vocabulary larger than these lines allow
                raise CorpusError(f"{files['train'][0]}: sentencepiece cannot train on its {len(lines)} sampled "
                                  f"training lines: {str(e).split('] ')[-1]}") from None
            if not own_cache:  # the command's progress (a run says what its cache holds once it accepts it); after
                # the training, so that a vocabulary sentencepiece refuses is the one line the command prints
                log.info("tokenizer: trained %s (vocab %d) on %d lines in %.1f s", spm.model_type, spm.vocab_size,
                         len(lines), time.perf_counter() - t1)
            del lines
        (tmp / MODEL_FILE).write_bytes(tokenizer.proto)
        t2 = time.perf_counter()
        splits, arrays, texts = _encode(files, infos, tokenizer, tmp, workers, progress, leave=not own_cache)
        t3 = time.perf_counter()
        manifest = {
            "format": "normlab data folder", "format_version": FORMAT_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": _versions(), "command": command, "name": name, "src_lang": src_lang, "tgt_lang": tgt_lang,
            "inputs": {f"{split}.{side}": infos[split, side].identity() for split, side in infos},
            "tokenizer": {"file": MODEL_FILE, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
                          "trained": sample_lines is not None, "settings": asdict(spm) if sample_lines is not None
                          else None, "sample_lines": sample_lines,
                          "given": None if sample_lines is not None else str(tokenizer.path or "checkpoint")},
            "token_dtype": np.dtype(token_dtype(tokenizer.vocab_size)).str,
            "splits": splits, "arrays": arrays, "texts": texts,
            "seconds": {"scan": round(t1 - t0, 2), "tokenizer": round(t2 - t1, 2), "encode": round(t3 - t2, 2)},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last: a folder without it is never read
        sync_tree(tmp)  # every file durable (the arrays already are) before the folder is renamed into place
        _publish(tmp, out, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; removed on any error or Ctrl-C
    train = splits["train"]
    if not own_cache:
            log.info("%s: %d train pairs (%d dropped), %d + %d tokens, in %.1f s -> %s", name, train["pairs"],
                 train["lines"] - train["pairs"], train["tokens"]["src"], train["tokens"]["tgt"],
                 time.perf_counter() - t0, out)
    return manifest


def sample_training_lines(train: tuple[str | Path, str | Path], counts: tuple[int, int], sample: int,
                          seed: int) -> list[str]:
    """The non-empty training lines sentencepiece learns from: source lines, then target lines.
    All of them if sample is 0 or covers both files, else a uniform draw of `sample` line numbers
    with numpy's generator seeded by `seed` (empty lines among them are skipped)."""
    total = sum(counts)
    picks = None
    if 0 < sample < total:
        picks = np.sort(np.random.default_rng(seed).choice(total, size=sample, replace=False))
    out: list[str] = []
    base = 0
    for path, count in zip(train, counts):
        with LineReader(path) as reader:
            while True:
                first, offset, raw = reader.take(10 * CHUNK)
                if not raw:
                    break
                lo = base + first - 1
                if picks is None:
                    chosen = range(len(raw))
                else:
                    chosen = picks[np.searchsorted(picks, lo):np.searchsorted(picks, lo + len(raw))] - lo
                    if not len(chosen):
                        continue
                text = decode_lines(raw, path, first, offset)
                out += [line for line in (text[i] for i in chosen) if line.strip()]
        base += count
    return out


# -- encoding ---------------------------------------------------------------------------------
_SP = None  # the worker's sentencepiece processor


def _init_worker(proto: bytes) -> None:
    global _SP
    import sentencepiece

    _SP = sentencepiece.SentencePieceProcessor(model_proto=proto)


def _flat(ids: list[list[int]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    return np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum())), lengths


def _encode_chunk(task: tuple, sp=None) -> tuple:
    """One chunk of aligned raw lines -> (src tokens, src lengths, tgt tokens, tgt lengths,
    pairs dropped as empty, (src text, tgt text) or None). `sp`: the processor, else the worker's."""
    (src_path, src_at, src_raw), (tgt_path, tgt_at, tgt_raw), dtype, keep_text = task
    sp = sp or _SP
    src = [s.strip() for s in decode_lines(src_raw, src_path, *src_at)]
    tgt = [t.strip() for t in decode_lines(tgt_raw, tgt_path, *tgt_at)]
    keep = [i for i, (s, t) in enumerate(zip(src, tgt)) if s and t]
    if len(keep) < len(src):
        src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
    dtype = np.dtype(dtype)
    text = ("".join(s + "\n" for s in src), "".join(t + "\n" for t in tgt)) if keep_text else None
    return (*_flat(sp.encode(src, out_type=int), dtype), *_flat(sp.encode(tgt, out_type=int), dtype),
            len(src_raw) - len(keep), text)


def _tasks(split: str, paths: tuple[Path, Path], dtype: str, keep_text: bool):
    with LineReader(paths[0]) as a, LineReader(paths[1]) as b:
        while True:
            la, oa, xa = a.take(CHUNK)
            lb, ob, xb = b.take(CHUNK)
            if len(xa) != len(xb):  # scan counted equal lines: a file changed while we read it
                raise CorpusError(f"{paths[0] if len(xa) < len(xb) else paths[1]}: changed while being read")
            if not xa:
                return
            yield (str(paths[0]), (la, oa), xa), (str(paths[1]), (lb, ob), xb), dtype, keep_text


def _ordered(fn, tasks, pool, depth: int):
    """fn over tasks in order; with a pool, at most `depth` tasks in flight (Pool.imap would read
    the whole corpus into its queue)."""
    if pool is None:
        yield from map(fn, tasks)
        return
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.apply_async(fn, (task,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _encode(files, infos, tokenizer: Tokenizer, tmp: Path, workers: int, progress: bool, leave: bool = True):
    dtype = token_dtype(tokenizer.vocab_size)
    total = sum(infos[split, "src"].lines for split in SPLITS)
    # leave=False (a run's cache): the bar is gone when done, so a refusal after it is still one line
    bar = tqdm(total=total, unit="pairs", unit_scale=True, desc="encode", disable=not progress, file=sys.stderr,
               dynamic_ncols=True, leave=leave)
    pool, encode = None, functools.partial(_encode_chunk, sp=tokenizer.sp)
    if workers > 1:  # spawn: no fork of a process that may hold torch's threads and locks
        pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer.proto,))
        encode = _encode_chunk
    splits, arrays, texts = {}, {}, {}
    opened = contextlib.ExitStack()  # a refused split (check_pairs) closes what it opened: the folder is discarded
    try:
        for split in SPLITS:
            writers = {side: ArrayWriter(tmp / f"{split}.{side}", dtype) for side in SIDES}
            keep_text = split != "train"
            text_files = {side: open(tmp / f"{split}.{side}.txt", "wb") for side in SIDES} if keep_text else {}
            for f in [*(w.file for w in writers.values()), *text_files.values()]:
                opened.callback(f.close)  # a no-op for a file already closed
            dropped = lines = 0
            paths = (Path(files[split][0]), Path(files[split][1]))
            for s_tok, s_len, t_tok, t_len, n_empty, text in _ordered(
                    encode, _tasks(split, paths, dtype.str, keep_text), pool, 2 * workers):
                writers["src"].append(s_tok, s_len)
                writers["tgt"].append(t_tok, t_len)
                for side, chunk in zip(SIDES, text or ()):
                    text_files[side].write(chunk.encode("utf-8"))
                dropped += n_empty
                lines += len(s_len) + n_empty
                bar.update(len(s_len) + n_empty)
            stats = {"lines": lines, "pairs": lines - dropped, "dropped_empty": dropped}
            check_pairs(*paths, stats)
            specs = {side: writers[side].close() for side in SIDES}
            for side, f in text_files.items():
                f.close()
                texts[f"{split}.{side}.txt"] = {"bytes": (tmp / f"{split}.{side}.txt").stat().st_size}
            arrays.update({f"{split}.{side}.{kind}": spec for side in SIDES for kind, spec in specs[side].items()})
            splits[split] = {"lines": lines, "pairs": lines - dropped, "dropped": {"empty": dropped},
                             "tokens": {side: specs[side]["tokens"]["count"] for side in SIDES}}
    finally:
        opened.close()
        bar.close()
        if pool is not None:
            pool.terminate()
    return splits, arrays, texts


def sync_tree(folder: Path) -> None:
    """fsync every file below `folder` and the folder itself: spm.model, the references and the
    manifest, not only the arrays, so a crash after the rename never leaves a folder that reads
    complete but holds empty files."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(out: Path, inputs: list, own_cache: bool = False) -> None:
    """--force deletes `out`: refuse anything but a data folder preprocess wrote (or an empty folder),
    and any folder that holds one of the inputs."""
    resolved = out.resolve()
    for p in inputs:
        if resolved in Path(p).resolve().parents:
            raise CorpusError(f"{out}: holds the input file {p}; --force would delete it (write the data folder "
                              "elsewhere)")
    if not out.is_dir():
        raise CorpusError(f"{out}: is a file, not a data folder; --force replaces only a folder that preprocess "
                          "wrote (allowed: a new path, or a normlab data folder)")
    if own_cache or not any(out.iterdir()):
        return
    try:
        fmt = json.loads((out / MANIFEST).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        fmt = None
    if fmt != "normlab data folder":
        raise CorpusError(f"{out}: not a normlab data folder (no {MANIFEST} written by preprocess); --force replaces "
                          "only those (allowed: a new path, or a normlab data folder)")


def _publish(tmp: Path, out: Path, force: bool) -> None:
    if not out.exists():
        try:
            os.rename(tmp, out)
            return
        except OSError:  # another process published the same folder first
            if not force:
                return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import sentencepiece

    try:
        normlab = version("normlab")
    except PackageNotFoundError:
        normlab = None
    return {"normlab": normlab, "sentencepiece": sentencepiece.__version__, "numpy": np.__version__}

