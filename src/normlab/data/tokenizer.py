"""Joint sentencepiece subword model over source + target (trained by preprocessing, stored in the data folder)."""
from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from normlab.data.corpus import CorpusError

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
        input_sentence_size=0,  # every line given: preprocessing drew the sample, reproducibly
        minloglevel=2,  # no per-iteration log spam on stderr
        num_threads=settings["num_threads"],
    )
    return writer.getvalue()


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
    def train(cls, lines: Sequence[str], vocab_size: int, model_type: str = "bpe",
              character_coverage: float = 1.0, seed: int = 1) -> "Tokenizer":
        """Train on `lines` (all of them: preprocessing draws the bounded sample). The thread
        count is fixed: sentencepiece stores it in the model, so another count would change the
        model's bytes (and its sha256, which data folders and checkpoints are matched by)."""
        return cls(_train_spm(lines, {"vocab_size": vocab_size, "model_type": model_type, "seed": seed,
                                      "character_coverage": character_coverage, "num_threads": 2}))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._proto).hexdigest()

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
        try:
            return cls(path.read_bytes(), path)
        except FileNotFoundError:
            raise CorpusError(f"{path}: sentencepiece model not found") from None
        except RuntimeError as e:  # sentencepiece cannot parse it
            raise CorpusError(f"{path}: not a sentencepiece model ({e})") from None
        except ValueError as e:  # special ids other than normlab's
            raise CorpusError(str(e)) from None

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
