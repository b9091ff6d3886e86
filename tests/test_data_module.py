"""TranslationDataModule on a small slice of the bundled corpus (vocab 200: preprocessed in < 1 s)."""
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from normlab.config import ConfigError
from normlab.data.corpus import read_lines
from normlab.data.datamodule import TranslationDataModule, project_root, resolve_path

ROOT = Path(__file__).resolve().parents[1]
BIBLE = ROOT / "data" / "bible_de_en"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("dm")
    sizes = {"train": 400, "valid": 60, "test": 60}
    paths = {}
    for split, n in sizes.items():
        for side, lang in (("src", "de"), ("tgt", "en")):
            lines = read_lines(BIBLE / f"{split}.{lang}.gz")[:n]
            p = out / f"{split}.{lang}"
            p.write_text("\n".join(lines) + "\n", encoding="utf-8")
            paths[f"{split}_{side}"] = str(p)
    return {**paths, "cache_dir": str(out / "cache")}


def make(corpus, **kw):
    args = dict(vocab_size=200, max_tokens=600, max_positions=64, src_lang="de", tgt_lang="en",
                name="toy", unknown_hydra_key=1)
    dm = TranslationDataModule(**corpus, **{**args, **kw})
    dm.setup("fit")
    return dm


def mapped(ds) -> bool:
    # A pickled np.memmap comes back as an np.memmap without a file: check the file.
    return all(getattr(a, "filename", None) for side in (ds.src, ds.tgt) for a in (side.tokens, side.lengths))


def all_idx(loader):
    return [i for b in loader for i in b["idx"].tolist()]


def test_train_drops_long_pairs_and_idx_addresses_the_pair(corpus):
    dm = make(corpus)
    tok = dm.tokenizer
    text = {side: [line.strip() for line in read_lines(corpus[f"train_{side}"])] for side in ("src", "tgt")}
    src, tgt = tok.encode(text["src"]), tok.encode(text["tgt"])
    fits = [i for i in range(len(src)) if len(src[i]) < 64 and len(tgt[i]) < 64]
    assert 0 < len(fits) < 400  # the limit really bites at vocab 200
    assert dm.num_train_pairs == len(fits) and dm.stats["train"]["dropped_long"] == 400 - len(fits)
    seen = []
    for b in dm.train_dataloader():
        assert b["src"].numel() <= 600 and b["tgt_out"].numel() <= 600
        assert b["src"].size(1) <= 64 and b["tgt_in"].size(1) <= 64
        assert tok.decode(b["tgt_out"]) == [text["tgt"][i] for i in b["idx"].tolist()]
        assert tok.decode(b["src"]) == [text["src"][i] for i in b["idx"].tolist()]
        seen += b["idx"].tolist()
    assert sorted(seen) == fits


def test_max_positions_that_drops_every_pair_names_the_key(corpus):
    with pytest.raises(ConfigError, match=r"model\.max_positions=3 drops every one of the 400 training pairs"):
        make(corpus, max_positions=3)


def test_eval_keeps_every_pair_and_truncates_sources(corpus):
    dm = make(corpus)
    assert dm.stats["valid"]["truncated_src"] > 0  # the test below is about those
    for split in ("valid", "test"):
        loader = dm.dataloader(split)
        assert sorted(all_idx(loader)) == list(range(60))
        assert all_idx(loader) == all_idx(dm.dataloader(split))  # no shuffle
        assert max(b["src"].size(1) for b in loader) <= 64
        assert len(dm.references(split)) == len(dm.sources(split)) == 60
    assert dm.eval_max_tokens == 1200
    assert len(dm.val_dataloader()) < len(dm.dataloader("train"))


def test_epoch_and_ddp_come_from_the_trainer(corpus):
    dm = make(corpus)
    dm.trainer = SimpleNamespace(world_size=1, global_rank=0, current_epoch=0)
    loader = dm.train_dataloader()
    e0 = all_idx(loader)
    dm.trainer.current_epoch = 1
    assert all_idx(loader) != e0 and sorted(all_idx(loader)) == sorted(e0)
    dm.trainer.current_epoch = 0
    assert all_idx(loader) == e0
    shards = []
    for rank in (0, 1):
        # what a spawned rank or a DataLoader worker receives: the arrays re-opened by path, not copied
        rank_dm = pickle.loads(pickle.dumps(dm))
        assert mapped(rank_dm.datasets["train"])
        rank_dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, current_epoch=0)
        shards.append(rank_dm.train_dataloader())
    assert len(shards[0]) == len(shards[1]) == -(-len(loader) // 2)
    a, b = (set(all_idx(s)) for s in shards)
    assert a | b == set(e0)
    padded = 2 * len(shards[0]) - len(loader)
    assert len(a & b) == 0 or padded == 1


class _Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.orders: dict[int, list[int]] = {}
        self.batches: list[list[int]] = []

    def training_step(self, batch, _):
        self.orders.setdefault(self.current_epoch, []).extend(batch["idx"].tolist())
        self.batches.append(batch["idx"].tolist())
        return (self.w * batch["ntokens"]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_fit_reshuffles_each_epoch(corpus):
    dm = TranslationDataModule(**corpus, vocab_size=200, max_tokens=2000, max_positions=64)
    model = _Recorder()
    L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              ).fit(model, datamodule=dm)
    e0, e1 = model.orders[0], model.orders[1]
    assert sorted(e0) == sorted(e1) and len(e0) == dm.num_train_pairs
    assert e0 != e1


def test_relative_paths_resolve_against_project_root(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert project_root() == ROOT
    assert resolve_path("data/bible_de_en/train.de.gz") == BIBLE / "train.de.gz"
    assert resolve_path(tmp_path / "x") == tmp_path / "x"


def _fit(dm, model, ckpt=None, **kw):
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, **kw)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)


class _SaveAt(L.Callback):
    """Saves a checkpoint where ModelCheckpoint(every_n_train_steps) would: after batch k."""

    def __init__(self, k: int, path):
        self.k, self.path = k, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.k:
            trainer.save_checkpoint(self.path)


def test_lightning_resumes_mid_epoch_with_the_next_batch(corpus, tmp_path):
    """The train loader is stateful in Lightning's sense: a checkpoint taken after k batches of
    epoch 0 stores (epoch 0, position k), and the resumed fit trains on exactly the batches the
    uninterrupted one would have (rest of epoch 0, then epoch 1)."""
    make_dm = lambda: TranslationDataModule(**corpus, vocab_size=200, max_tokens=600, max_positions=64)
    whole = _Recorder()
    _fit(make_dm(), whole, max_epochs=2, callbacks=[_SaveAt(3, tmp_path / "mid.ckpt")])
    loops = torch.load(tmp_path / "mid.ckpt", weights_only=False)["loops"]["fit_loop"]
    assert loops["state_dict"]["combined_loader"] == [{"epoch": 0, "position": 3}]
    rest = _Recorder()
    _fit(make_dm(), rest, ckpt=str(tmp_path / "mid.ckpt"), max_epochs=2)
    first_three = whole.orders[0][:sum(len(b) for b in whole.batches[:3])]
    assert first_three + rest.orders[0] == whole.orders[0]
    assert rest.orders[1] == whole.orders[1]


class _ShardRecorder(_Recorder):
    """Each DDP rank writes the pairs it trained on, and whether they came from a memory map."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def on_train_epoch_end(self):
        ds = self.trainer.datamodule.datasets["train"]
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps({"batches": self.batches,
                                                                          "mapped": mapped(ds)}))


@pytest.mark.slow  # ~6 s alone: two spawned processes import torch and Lightning
def test_ddp_ranks_read_disjoint_equal_count_shards_from_the_memory_map(corpus, tmp_path):
    dm = TranslationDataModule(**corpus, vocab_size=200, max_tokens=600, max_positions=64)
    _fit(dm, _ShardRecorder(tmp_path), max_epochs=1, strategy="ddp_spawn", devices=2, use_distributed_sampler=False)
    shards = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(s["mapped"] for s in shards)
    a, b = ([i for batch in s["batches"] for i in batch] for s in shards)
    assert len(shards[0]["batches"]) == len(shards[1]["batches"])
    dm.setup("fit")
    pairs = dm.num_train_pairs
    n_batches = dm.train_dataloader().batch_sampler.num_batches
    assert set(a) | set(b) == set(dm.datasets["train"].rows.tolist()) and len(set(a) | set(b)) == pairs
    if n_batches % 2 == 0:
        assert not set(a) & set(b) and len(a) + len(b) == pairs
    else:  # one batch repeated from the start to even the count
        assert len(shards[0]["batches"]) == (n_batches + 1) // 2
