"""The memory-mapped path gives the bundled corpus exactly the batches of the path it replaced.

tests/data/bundled_batches_a32ede7.json was computed at commit a32ede7 (per-pair Python lists,
tokenizer trained on every line) by hashing every collated batch with batch_fingerprint below,
for the default settings and for a max_positions that drops and cuts pairs. Equal tensors in
equal order mean equal losses and equal BLEU for the same model."""
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from normlab.data.datamodule import TranslationDataModule

ROOT = Path(__file__).resolve().parents[1]
FINGERPRINT = json.loads((ROOT / "tests" / "data" / "bundled_batches_a32ede7.json").read_text())
BIBLE = {f"{split}_{side}": f"data/bible_de_en/{split}.{lang}.gz" for split in ("train", "valid", "test")
         for side, lang in (("src", "de"), ("tgt", "en"))}


def batch_fingerprint(batches) -> dict:
    h, n = hashlib.sha256(), 0
    for b in batches:
        for k in ("idx", "src", "tgt_in", "tgt_out"):
            t = b[k]
            h.update(k.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(np.ascontiguousarray(t.numpy().astype(np.int64)).tobytes())
        h.update(str(b["ntokens"]).encode())
        n += 1
    return {"batches": n, "sha256": h.hexdigest()}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("variant", ["max_positions256_seed1", "max_positions40_seed5"])
def test_bundled_corpus_batches_equal_the_old_path(variant, cache):
    want = FINGERPRINT[variant]
    max_positions, seed = (256, 1) if variant.endswith("256_seed1") else (40, 5)
    dm = TranslationDataModule(**BIBLE, vocab_size=8000, max_tokens=want["max_tokens"],
                               eval_max_tokens=want["eval_max_tokens"], max_positions=max_positions,
                               cache_dir=str(cache), seed=seed)
    dm.setup("fit")
    if "tokenizer_sha256" in want:
        assert dm.tokenizer.sha256 == want["tokenizer_sha256"]
    assert dm.num_train_pairs == want["train_pairs"]
    assert dm.stats["train"]["dropped_long"] == want["stats"]["train"]["dropped_long"]
    for split in ("valid", "test"):
        for key in ("truncated_src", "truncated_tgt"):
            assert dm.stats[split][key] == want["stats"][split][key]
    for key, expected in want.items():
        if key.startswith("train/"):
            _, world, rank, epoch = key.split("/")
            dm.trainer = SimpleNamespace(world_size=int(world[5:]), global_rank=int(rank[4:]),
                                         current_epoch=int(epoch[5:]))
            assert batch_fingerprint(dm.train_dataloader()) == expected, key
        elif key.endswith("/world1"):
            dm.trainer = SimpleNamespace(world_size=1, global_rank=0, current_epoch=0)
            assert batch_fingerprint(dm.dataloader(key.split("/")[0])) == expected, key
        elif key.endswith("references_sha256"):
            refs = dm.references(key.split("/")[0])
            assert hashlib.sha256("\n".join(refs).encode()).hexdigest() == expected
