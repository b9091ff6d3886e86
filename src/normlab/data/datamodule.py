"""LightningDataModule: one data path from a preprocessed folder's memory-mapped arrays to
token-budget loaders, for training, validation, test and the commands.

`path` names a folder written by `python -m normlab.commands.preprocess` (data=preprocessed);
otherwise the six text files are preprocessed into `cache_dir` on first use (data=bible_de_en,
data=custom) and then read the same way. Length limits depend on the model, so they apply here:
training pairs that do not fit max_positions are dropped, held-out pairs are cut to fit.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

import lightning as L
import numpy as np

from normlab.config import ConfigError
from normlab.data.arrays import release_freed_memory
from normlab.data.batching import BatchLoader, PairDataset, batch_loader
from normlab.data.folder import DataFolder, built_line, cached_folder
from normlab.data.preprocess import SpmSettings
from normlab.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")


def _is_normlab_root(d: Path) -> bool:
    f = d / "pyproject.toml"
    return f.is_file() and 'name = "normlab"' in f.read_text(errors="replace")


@functools.cache
def project_root() -> Path:
    """$NORMLAB_ROOT if set; else the nearest ancestor holding normlab's pyproject.toml, searched
    from this file (an editable install lives in the checkout) and then from the cwd (Hydra may
    have changed it into outputs/, which still lies below the checkout); else the cwd."""
    if os.environ.get("NORMLAB_ROOT"):
        return Path(os.environ["NORMLAB_ROOT"]).resolve()
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        for d in (start, *start.parents):
            if _is_normlab_root(d):
                return d
    return Path.cwd().resolve()


def resolve_path(path: str | os.PathLike) -> Path:
    """Absolute paths unchanged; relative ones are relative to project_root(), not the cwd, so
    `data/bible_de_en/train.de.gz` means the same file whatever directory a run starts in."""
    p = Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else project_root() / p


def fits(lengths: np.ndarray, max_positions: int) -> np.ndarray:
    # +1: collate appends EOS to the source and prepends BOS to the target input.
    return lengths < max_positions  # no int copy of a length array per side


class TranslationDataModule(L.LightningDataModule):
    def __init__(
        self,
        train_src: str | None = None, train_tgt: str | None = None,
        valid_src: str | None = None, valid_tgt: str | None = None,
        test_src: str | None = None, test_tgt: str | None = None,
        path: str | None = None,  # a preprocessed folder, instead of the six text files
        vocab_size: int | None = None,  # None: 8000 for text files; the folder's own with path
        spm_model_type: str = "bpe",
        spm_character_coverage: float = 1.0,
        spm_sample: int = 1_000_000,
        spm_seed: int = 1,
        max_tokens: int = 2048,
        eval_max_tokens: int | None = None,
        max_positions: int = 256,
        cache_dir: str = ".cache/normlab",
        seed: int = 1,
        num_workers: int = 0,
        preprocess_workers: int | None = None,
        check_inputs: bool = True,
        src_lang: str = "src",
        tgt_lang: str = "tgt",
        name: str | None = None,
        shuffle: bool = True,  # false: training batches in a fixed order (debug=overfit)
        tokenizer: Tokenizer | None = None,  # given (e.g. a checkpoint's): the data must be encoded with it
        tokenizer_owner: str = "the checkpoint",
        **kwargs,  # other keys of the Hydra data group (e.g. notes); not used here
    ):
        super().__init__()
        texts = {"train": (train_src, train_tgt), "valid": (valid_src, valid_tgt), "test": (test_src, test_tgt)}
        self.path = resolve_path(path) if path else None
        self.paths = None if path else {s: tuple(resolve_path(p) for p in pair) for s, pair in texts.items()}
        self.vocab_size = vocab_size
        self.spm = SpmSettings(vocab_size or 8000, spm_model_type, spm_character_coverage, spm_sample, spm_seed)
        self.max_tokens = max_tokens
        self.eval_max_tokens = eval_max_tokens or 2 * max_tokens
        self.max_positions = max_positions
        self.cache_dir = resolve_path(cache_dir)
        self.seed, self.num_workers, self.preprocess_workers = seed, num_workers, preprocess_workers
        self.check_inputs, self.shuffle = check_inputs, shuffle
        self.src_lang, self.tgt_lang, self.name = src_lang, tgt_lang, name
        self._given_tokenizer, self._owner = tokenizer, tokenizer_owner
        self.folder: DataFolder | None = None
        self.tokenizer: Tokenizer | None = None
        self.datasets: dict[str, PairDataset] = {}
        self._text: dict[str, tuple[list[str], list[str]]] = {}
        self.stats: dict[str, dict] = {}

    def _open(self) -> DataFolder:
        if self.folder is not None:
            return self.folder
        if self.path is None:
            folder = cached_folder(self.paths, self.cache_dir, self.spm, self.name or "corpus", self.src_lang,
                                   self.tgt_lang, self._given_tokenizer, self.preprocess_workers,
                                   progress=sys.stderr.isatty())
        else:
            folder = DataFolder.open(self.path, check_inputs=self.check_inputs)
            vocab = folder.manifest["tokenizer"]["vocab_size"]
            if self.vocab_size is not None and self.vocab_size != vocab:  # the run would report what did not run
                raise ConfigError(f"data.vocab_size={self.vocab_size}, but the tokenizer of {self.path} has "
                                  f"{vocab} pieces; leave data.vocab_size null with data=preprocessed")
            if self._given_tokenizer is not None:
                folder.check_tokenizer(self._given_tokenizer, self._owner, (
                    "python -m normlab.commands.preprocess ... --spm-model <run>/tokenizer/spm.model "
                    "--out NEW_FOLDER, then data.path=NEW_FOLDER"))
        self.folder, self.name = folder, self.name or folder.name
        return folder

    def prepare_data(self) -> None:
        # Lightning runs this once per node before setup(); the cache is also locked, so ranks
        # that torchrun or SLURM start together still preprocess once.
        self._open()

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:  # idempotent: Lightning calls setup once per stage
            return
        folder = self._open()
        self.tokenizer = self._given_tokenizer or folder.tokenizer
        limit = self.max_positions - 1  # room for EOS / BOS
        for split in SPLITS:
            src, tgt = folder.arrays(split)
            stats = dict(folder.manifest["splits"][split])
            if split == "train":
                fit = fits(src.lengths, self.max_positions) & fits(tgt.lengths, self.max_positions)
                keep = None if fit.all() else np.flatnonzero(fit).astype(np.int32)  # None: every pair
                del fit
                stats["dropped_long"] = 0 if keep is None else len(src) - len(keep)
                if keep is not None and not len(keep):
                    shortest = int(np.maximum(src.lengths, tgt.lengths).min()) + 1
                    raise ConfigError(f"model.max_positions={self.max_positions} drops every one of the {len(src)} "
                                      f"training pairs of {self.name} (the shortest needs {shortest} positions)")
                if stats["dropped_long"]:
                    log.warning("%s/train: dropped %d of %d pairs longer than max_positions=%d (incl. EOS/BOS)",
                                self.name, stats["dropped_long"], len(src), self.max_positions)
                self.datasets[split] = PairDataset(src, tgt, keep)
            else:
                # Never drop held-out pairs: BLEU must cover the whole valid/test set. Over-long
                # sources are cut to fit the positions (and targets, which only feed the loss;
                # BLEU uses the untouched references()).
                stats.update(truncated_src=int((src.lengths > limit).sum()),
                             truncated_tgt=int((tgt.lengths > limit).sum()))
                if stats["truncated_src"] or stats["truncated_tgt"]:
                    log.warning("%s/%s: truncated %d sources and %d targets to max_positions=%d", self.name,
                                split, stats["truncated_src"], stats["truncated_tgt"], self.max_positions)
                self.datasets[split] = PairDataset(src, tgt, limit=limit)
                self._text[split] = (folder.text(split, "src"), folder.text(split, "tgt"))
            self.stats[split] = stats
        release_freed_memory()  # the length filter's and sizes' temporaries
        if folder.built:
            log.info("%s", built_line(folder))
        log.info("%s", stats_line(self.name, self.stats))

    # -- raw text of the held-out splits, index-aligned with batch["idx"] -----------------------
    def sources(self, split: str) -> list[str]:
        return self._held_out(split)[0]

    def references(self, split: str) -> list[str]:
        return self._held_out(split)[1]

    def _held_out(self, split: str) -> tuple[list[str], list[str]]:
        if split not in self._text:
            raise KeyError(f"no text is kept for the {split!r} split (valid and test only)")
        return self._text[split]

    @property
    def num_train_pairs(self) -> int:
        return len(self.datasets["train"])

    # -- loaders ------------------------------------------------------------------------------
    def _replicas(self) -> tuple[int, int]:
        # The batch sampler shards itself, so under DDP the Trainer needs
        # use_distributed_sampler=False (Lightning cannot wrap a custom batch sampler).
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def _epoch(self) -> int | None:
        trainer = getattr(self, "trainer", None)
        return None if trainer is None else trainer.current_epoch

    def dataloader(self, split: str, rows: Sequence[int] | None = None) -> BatchLoader:
        """Train: shuffled batches, new order each epoch, resumable. Other splits: length-sorted, fixed.
        `rows` (a held-out split): only those sentences, sources only (decoding a subset: batch["idx"]
        still numbers the split's sentences), in batches of their own, sharded as the whole split is."""
        if not self.datasets:
            self.setup()
        num_replicas, rank = self._replicas()
        train = split == "train"
        dataset = self.datasets[split]
        if rows is not None:
            if train:
                raise ValueError("rows= selects sentences of a held-out split, not of train")
            dataset = PairDataset(dataset.src, None, dataset.rows[np.asarray(rows, dtype=np.int64)], dataset.limit)
        loader = batch_loader(dataset, self.max_tokens if train else self.eval_max_tokens,
                              shuffle=train and self.shuffle, seed=self.seed, num_replicas=num_replicas, rank=rank,
                              epoch_fn=self._epoch if train else None, num_workers=self.num_workers)
        release_freed_memory()  # the batch order's temporaries
        return loader

    def train_dataloader(self) -> BatchLoader:
        return self.dataloader("train")

    def val_dataloader(self) -> BatchLoader:
        return self.dataloader("valid")

    def test_dataloader(self) -> BatchLoader:
        return self.dataloader("test")


def stats_line(name: str, stats: dict) -> str:
    """The corpus in one readable line: pairs per split, tokens and what was dropped or cut."""
    parts = []
    for split, st in stats.items():
        text = f"{split} {st.get('pairs', 0):,} pairs"
        tok = st.get("tokens") or {}
        if tok:
            text += f" ({tok.get('src', 0):,} + {tok.get('tgt', 0):,} tokens)"
        dropped = {**(st.get("dropped") or {}), "long": st.get("dropped_long", 0)}
        dropped = {k: v for k, v in dropped.items() if v}
        if dropped:
            text += ", dropped " + ", ".join(f"{v:,} {k}" for k, v in dropped.items())
        cut = st.get("truncated_src", 0) + st.get("truncated_tgt", 0)
        if cut:
            text += f", {st.get('truncated_src', 0)} sources / {st.get('truncated_tgt', 0)} targets cut"
        parts.append(text)
    return f"{name}: " + "; ".join(parts)
