"""Tokenizer: fixed special ids, cache reuse keyed on data + settings, exact round trips."""
import itertools

import pytest

from normlab.data import tokenizer as tokmod
from normlab.data.tokenizer import Tokenizer

WORDS_DE = "der die das Haus Baum Wasser Licht Erde Himmel sprach sah gut groß klein und nicht".split()
WORDS_EN = "the house tree water light earth heaven spoke saw good great small and not".split()
VOCAB = 200


def synthetic(words, n, shift=0):
    # Deterministic word triples: enough distinct character pairs for a 200-piece BPE vocab.
    triples = itertools.islice(itertools.product(words, repeat=3), shift, shift + n)
    sentences = [" ".join(t) + "." for t in triples]
    return [s[0].upper() + s[1:] for s in sentences]


@pytest.fixture
def train_files(tmp_path):
    src, tgt = tmp_path / "train.de", tmp_path / "train.en"
    src.write_text("\n".join(synthetic(WORDS_DE, 300)) + "\n")
    tgt.write_text("\n".join(synthetic(WORDS_EN, 300)) + "\n")
    return [str(src), str(tgt)]


@pytest.fixture
def count_trainings(monkeypatch):
    calls = []
    real = tokmod._train_spm

    def counting(lines, settings):
        calls.append(settings)
        return real(lines, settings)

    monkeypatch.setattr(tokmod, "_train_spm", counting)
    return calls


def test_special_ids_and_vocab(train_files, tmp_path):
    tok = Tokenizer.train_or_load(train_files, VOCAB, tmp_path / "cache")
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == VOCAB
    assert [tok.sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]


def test_second_call_reuses_cache(train_files, tmp_path, count_trainings):
    cache = tmp_path / "cache"
    a = Tokenizer.train_or_load(train_files, VOCAB, cache)
    b = Tokenizer.train_or_load(train_files, VOCAB, cache)
    assert len(count_trainings) == 1
    assert a.path == b.path and a.path.parent.parent == cache
    assert [p.name for p in cache.iterdir()] == [a.path.parent.name]  # no temp dir left behind


def test_changed_settings_or_data_change_the_key(train_files, tmp_path, count_trainings):
    cache = tmp_path / "cache"
    base = Tokenizer.train_or_load(train_files, VOCAB, cache).path.parent
    other_vocab = Tokenizer.train_or_load(train_files, VOCAB - 20, cache).path.parent
    other_seed = Tokenizer.train_or_load(train_files, VOCAB, cache, seed=2).path.parent
    other_cov = Tokenizer.train_or_load(train_files, VOCAB, cache, character_coverage=0.9995).path.parent
    with open(train_files[1], "a") as f:
        f.write("One more line.\n")
    other_data = Tokenizer.train_or_load(train_files, VOCAB, cache).path.parent
    assert len({base, other_vocab, other_seed, other_cov, other_data}) == 5
    assert len(count_trainings) == 5


def test_training_is_byte_deterministic(train_files, tmp_path):
    a = Tokenizer.train_or_load(train_files, VOCAB, tmp_path / "c1")
    b = Tokenizer.train_or_load(train_files, VOCAB, tmp_path / "c2")
    assert a.path.read_bytes() == b.path.read_bytes()


def test_concurrent_winner_is_kept(train_files, tmp_path, monkeypatch):
    """Another run publishes the model while we are still training: we must neither fail nor
    overwrite it, and must remove our temp dir."""
    cache = tmp_path / "cache"
    real = tokmod._train_spm

    def racing(lines, settings):
        proto = real(lines, settings)
        key = tokmod.cache_key(lines, {k: v for k, v in settings.items() if k != "num_threads"})
        (cache / key).mkdir(parents=True)
        (cache / key / "spm.model").write_bytes(proto)
        (cache / key / "winner").write_text("x")
        return proto

    monkeypatch.setattr(tokmod, "_train_spm", racing)
    tok = Tokenizer.train_or_load(train_files, VOCAB, cache)
    assert (tok.path.parent / "winner").exists()
    assert [p.name for p in cache.iterdir()] == [tok.path.parent.name]
    assert tok.decode(tok.encode(["Das Haus."])) == ["Das Haus."]


def test_round_trip_and_save_load(train_files, tmp_path):
    tok = Tokenizer.train_or_load(train_files, VOCAB, tmp_path / "cache")
    lines = ["Das Haus sprach nicht.", "The small tree saw good water.", "Licht und Erde"]
    ids = tok.encode(lines)
    assert all(i not in (0, 1, 2) for seq in ids for i in seq)  # no specials added by encode
    assert tok.decode(ids) == lines
    saved = tok.save(tmp_path / "run")
    assert saved == tmp_path / "run" / "spm.model"
    again = Tokenizer.load(tmp_path / "run")
    assert again.encode(lines) == ids and again.vocab_size == tok.vocab_size
    from_bytes = Tokenizer.from_proto(tok.proto)
    assert from_bytes.encode(lines) == ids and from_bytes.proto == saved.read_bytes()


def test_decode_stops_at_eos_and_skips_pad_bos(train_files, tmp_path):
    import torch

    tok = Tokenizer.train_or_load(train_files, VOCAB, tmp_path / "cache")
    ids = tok.encode(["Das Haus."])[0]
    noisy = torch.tensor([tok.bos_id, *ids, tok.eos_id, *ids, tok.pad_id])
    assert tok.decode([noisy]) == ["Das Haus."]
