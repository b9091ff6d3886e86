"""LightningDataModule: read + validate the three splits, tokenizer, token-budget loaders."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from normlab.data.batching import TokenBatchSampler, TranslationDataset, collate
from normlab.data.corpus import filter_by_length, read_parallel, truncate
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


class TranslationDataModule(L.LightningDataModule):
    def __init__(
        self,
        train_src: str, train_tgt: str,
        valid_src: str, valid_tgt: str,
        test_src: str, test_tgt: str,
        vocab_size: int = 8000,
        max_tokens: int = 2048,
        eval_max_tokens: int | None = None,
        max_positions: int = 256,
        cache_dir: str = ".cache/normlab",
        seed: int = 1,
        num_workers: int = 0,
        src_lang: str = "src",
        tgt_lang: str = "tgt",
        name: str = "corpus",
        tokenizer: Tokenizer | None = None,  # given (e.g. a checkpoint's): used instead of training one
        **kwargs,  # other keys of the Hydra data group (e.g. notes); not used here
    ):
        super().__init__()
        self.paths = {
            "train": (resolve_path(train_src), resolve_path(train_tgt)),
            "valid": (resolve_path(valid_src), resolve_path(valid_tgt)),
            "test": (resolve_path(test_src), resolve_path(test_tgt)),
        }
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.eval_max_tokens = eval_max_tokens or 2 * max_tokens
        self.max_positions = max_positions
        self.cache_dir = resolve_path(cache_dir)
        self.seed, self.num_workers = seed, num_workers
        self.src_lang, self.tgt_lang, self.name = src_lang, tgt_lang, name
        self.tokenizer: Tokenizer | None = None
        self._given_tokenizer = tokenizer
        self._raw: dict[str, tuple[list[str], list[str]]] = {}
        self.datasets: dict[str, TranslationDataset] = {}
        self.stats: dict[str, dict] = {}

    def _train_tokenizer(self) -> Tokenizer:
        if self._given_tokenizer is not None:
            return self._given_tokenizer
        return Tokenizer.train_or_load(list(self.paths["train"]), self.vocab_size, self.cache_dir,
                                       seed=self.seed)

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node before setup(): train the tokenizer there
        # so DDP ranks load it instead of all training it at once (the cache's atomic rename
        # would make that safe too, only wasteful).
        self._train_tokenizer()

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:  # idempotent: Lightning calls setup once per stage
            return
        for split in SPLITS:  # read all three first: a broken test file should fail before training
            src, tgt, stats = read_parallel(*self.paths[split])
            self._raw[split] = (src, tgt)
            self.stats[split] = stats
        self.tokenizer = self._train_tokenizer()
        for split in SPLITS:
            src, tgt = (self.tokenizer.encode(x) for x in self._raw[split])
            if split == "train":
                keep, dropped = filter_by_length(src, tgt, self.max_positions, f"{self.name}/train")
                self.stats[split]["dropped_long"] = dropped
                self.datasets[split] = TranslationDataset([src[i] for i in keep],
                                                          [tgt[i] for i in keep], keep)
            else:
                # Never drop held-out pairs: BLEU must cover the whole valid/test set. Over-long
                # sources are cut to fit the positions (and targets, which only feed the loss;
                # BLEU uses the untouched references()).
                src, n_src = truncate(src, self.max_positions)
                tgt, n_tgt = truncate(tgt, self.max_positions)
                self.stats[split].update(truncated_src=n_src, truncated_tgt=n_tgt)
                if n_src or n_tgt:
                    log.warning("%s/%s: truncated %d sources and %d targets to max_positions=%d",
                                self.name, split, n_src, n_tgt, self.max_positions)
                self.datasets[split] = TranslationDataset(src, tgt)
        log.info("%s: %s", self.name, self.stats)

    # -- raw text, index-aligned with batch["idx"] --------------------------------------------
    def sources(self, split: str) -> list[str]:
        return self._raw[split][0]

    def references(self, split: str) -> list[str]:
        return self._raw[split][1]

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

    def dataloader(self, split: str) -> DataLoader:
        """Train: shuffled batches, new order each epoch. Other splits: length-sorted, fixed."""
        if not self.datasets:
            self.setup()
        ds = self.datasets[split]
        num_replicas, rank = self._replicas()
        train = split == "train"
        sampler = TokenBatchSampler(
            ds.src_sizes, ds.tgt_sizes,
            self.max_tokens if train else self.eval_max_tokens,
            shuffle=train, seed=self.seed, num_replicas=num_replicas, rank=rank,
            epoch_fn=self._epoch if train else None,
        )
        tok = self.tokenizer
        return DataLoader(
            ds, batch_sampler=sampler, num_workers=self.num_workers,
            collate_fn=functools.partial(collate, pad_id=tok.pad_id, bos_id=tok.bos_id,
                                         eos_id=tok.eos_id),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self.dataloader("train")

    def val_dataloader(self) -> DataLoader:
        return self.dataloader("valid")

    def test_dataloader(self) -> DataLoader:
        return self.dataloader("test")
