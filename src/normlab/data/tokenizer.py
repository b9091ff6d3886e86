"""Joint sentencepiece subword model over source + target, trained once per (data, settings)."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from normlab.data.corpus import read_lines

log = logging.getLogger(__name__)

# Fixed special ids shared with the model and collate (fairseq puts pad at 1; we do not).
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_FILE = "spm.model"


def _train_spm(lines: list[str], settings: dict) -> bytes:
    """Train and return the serialized model. A module function so tests can count calls."""
    writer = io.BytesIO()
    # model_writer instead of model_prefix: the prefix is stored inside the model proto, so a
    # temp-dir prefix would make identical trainings differ in bytes.
    spm.set_random_generator_seed(settings["seed"])
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=writer,
        vocab_size=settings["vocab_size"],
        model_type=settings["model_type"],
        character_coverage=settings["character_coverage"],
        pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
        input_sentence_size=0,  # use every line: no sampling, so nothing depends on the RNG
        minloglevel=2,  # no per-iteration log spam on stderr
        num_threads=settings["num_threads"],
    )
    return writer.getvalue()


def cache_key(lines: list[str], settings: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(spm.__version__.encode())  # another release may segment differently
    for line in lines:
        h.update(line.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()[:20]


class Tokenizer:
    # Fixed ids, set when sentencepiece is trained (pad 0, bos 1, eos 2, unk 3).
    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, model_proto: bytes, path: Path | None = None):
        self._proto = model_proto
        self.path = path
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        ids = (self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id(), self.sp.unk_id())
        if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise ValueError(f"{path}: special ids (pad, bos, eos, unk) are {ids}, "
                             f"expected {(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}")

    @classmethod
    def train_or_load(
        cls,
        train_files: Sequence[str | Path],
        vocab_size: int,
        cache_dir: str | Path,
        model_type: str = "bpe",
        character_coverage: float = 1.0,
        seed: int = 1,
        num_threads: int = 2,
    ) -> "Tokenizer":
        """Load cache_dir/<key>/spm.model, training it first if absent. The key hashes the
        training lines (all files, in order) and every setting except num_threads, which does
        not change the model."""
        lines = [line for f in train_files for line in read_lines(f) if line.strip()]
        settings = {"vocab_size": vocab_size, "model_type": model_type,
                    "character_coverage": character_coverage, "seed": seed}
        final = Path(cache_dir) / cache_key(lines, settings)
        if (final / MODEL_FILE).is_file():
            log.info("tokenizer: reusing %s", final / MODEL_FILE)
            return cls.load(final / MODEL_FILE)
        log.info("tokenizer: training %s on %d lines -> %s", model_type, len(lines), final)
        proto = _train_spm(lines, {**settings, "num_threads": num_threads})
        final.parent.mkdir(parents=True, exist_ok=True)
        # Write into a private temp dir, then rename it into place in one step: a concurrent run
        # (another DDP rank, another sweep job) sees either no directory or a complete model.
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        (tmp / MODEL_FILE).write_bytes(proto)
        (tmp / "settings.json").write_text(json.dumps(
            {**settings, "train_files": [str(f) for f in train_files], "lines": len(lines),
             "sentencepiece": spm.__version__}, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # someone else finished first; theirs is identical (deterministic)
            shutil.rmtree(tmp, ignore_errors=True)
        return cls.load(final / MODEL_FILE)

    @classmethod
    def from_proto(cls, model_proto: bytes) -> "Tokenizer":
        """From the serialized model, e.g. as stored inside a checkpoint."""
        return cls(model_proto)

    @property
    def proto(self) -> bytes:
        return self._proto

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if path.is_dir():
            path = path / MODEL_FILE
        return cls(path.read_bytes(), path)

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        out = directory / MODEL_FILE
        out.write_bytes(self._proto)
        return out

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()


    def encode(self, lines: Sequence[str]) -> list[list[int]]:
        """Subword ids without BOS/EOS (collate adds them)."""
        return self.sp.encode(list(lines), out_type=int)

    def decode(self, ids_lists: Sequence[Sequence[int]]) -> list[str]:
        """Detokenised text; each sequence is cut at its first EOS and pad/BOS are skipped, so
        raw decoder outputs can be passed in directly."""
        cleaned = []
        for ids in ids_lists:
            ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
            if EOS_ID in ids:
                ids = ids[: ids.index(EOS_ID)]
            cleaned.append([i for i in ids if i not in (PAD_ID, BOS_ID)])
        return self.sp.decode(cleaned)
