"""Tokenizer: fixed special ids, deterministic training, exact round trips, clear load errors."""
import itertools

import pytest

from normlab.data.corpus import CorpusError
from normlab.data.tokenizer import Tokenizer

WORDS_DE = "der die das Haus Baum Wasser Licht Erde Himmel sprach sah gut groß klein und nicht".split()
WORDS_EN = "the house tree water light earth heaven spoke saw good great small and not".split()
VOCAB = 200


def synthetic(words, n, shift=0):
    # Deterministic word triples: enough distinct character pairs for a 200-piece BPE vocab.
    triples = itertools.islice(itertools.product(words, repeat=3), shift, shift + n)
    sentences = [" ".join(t) + "." for t in triples]
    return [s[0].upper() + s[1:] for s in sentences]


@pytest.fixture(scope="module")
def lines():
    return synthetic(WORDS_DE, 300) + synthetic(WORDS_EN, 300)


def test_special_ids_and_vocab(lines):
    tok = Tokenizer.train(lines, VOCAB)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == VOCAB
    assert [tok.sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]


def test_training_is_byte_deterministic(lines):
    assert Tokenizer.train(lines, VOCAB).proto == Tokenizer.train(lines, VOCAB).proto
    assert Tokenizer.train(lines, VOCAB).sha256 != Tokenizer.train(lines, VOCAB - 20).sha256


def test_load_names_a_file_that_is_no_model(tmp_path):
    bad = tmp_path / "spm.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(CorpusError, match=f"{bad}: not a sentencepiece model"):
        Tokenizer.load(bad)
    with pytest.raises(CorpusError, match="sentencepiece model not found"):
        Tokenizer.load(tmp_path / "none.model")


def test_round_trip_and_save_load(lines, tmp_path):
    tok = Tokenizer.train(lines, VOCAB)
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


def test_decode_stops_at_eos_and_skips_pad_bos(lines):
    import torch

    tok = Tokenizer.train(lines, VOCAB)
    ids = tok.encode(["Das Haus."])[0]
    noisy = torch.tensor([tok.bos_id, *ids, tok.eos_id, *ids, tok.pad_id])
    assert tok.decode([noisy]) == ["Das Haus."]
