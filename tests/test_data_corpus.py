"""Corpus reading: every malformed input fails with CorpusError naming file and line."""
import gzip
import hashlib
import logging

import numpy as np
import pytest

from normlab.data import corpus
from normlab.data.corpus import CorpusError, LineReader, decode_lines, read_lines, read_parallel, scan
from normlab.data.datamodule import fits


def write(path, text: str | bytes):
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def test_reads_plain_and_gzip_identically(tmp_path):
    text = "eins\nzwei\r\ndrei\u2028mit Trenner\n"
    plain = write(tmp_path / "a.txt", text)
    gz = tmp_path / "a.txt.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    # \r\n is a line end; U+2028 is not (splitlines would have made 4 lines and shifted pairs).
    expected = ["eins", "zwei", "drei\u2028mit Trenner"]
    assert read_lines(plain) == expected
    assert read_lines(gz) == expected


def test_missing_file_names_it(tmp_path):
    src = write(tmp_path / "x.de", "a\n")
    with pytest.raises(CorpusError, match=r"nope\.en: corpus file not found"):
        read_parallel(src, tmp_path / "nope.en")


def test_count_mismatch_names_both_files_and_counts(tmp_path):
    src = write(tmp_path / "x.de", "a\nb\nc\n")
    tgt = write(tmp_path / "x.en", "a\nb\n")
    with pytest.raises(CorpusError) as e:
        read_parallel(src, tgt)
    msg = str(e.value)
    assert f"{src} has 3 lines" in msg and f"{tgt} has 2" in msg


@pytest.mark.parametrize("content", ["", "\n\n", " \n\t\n"])
def test_empty_corpus(tmp_path, content):
    src = write(tmp_path / "e.de", content)
    tgt = write(tmp_path / "e.en", content)
    with pytest.raises(CorpusError, match="empty corpus"):
        read_parallel(src, tgt)


def test_invalid_utf8_reports_line_and_offset(tmp_path):
    good = "erste\nzweite\n"
    bad = write(tmp_path / "bad.de", good.encode() + b"dri\xfftte\nvierte\n")
    tgt = write(tmp_path / "bad.en", "1\n2\n3\n4\n")
    with pytest.raises(CorpusError) as e:
        read_parallel(bad, tgt)
    offset = len(good.encode()) + 3
    assert f"{bad}:3:" in str(e.value)
    assert f"byte offset {offset}" in str(e.value) and "0xff" in str(e.value)


def test_invalid_utf8_inside_gzip(tmp_path):
    gz = tmp_path / "bad.en.gz"
    gz.write_bytes(gzip.compress(b"ok\n\xc3(\n"))
    with pytest.raises(CorpusError, match=r"bad\.en\.gz:2: .*byte offset 3"):
        read_lines(gz)


def test_empty_lines_dropped_with_count(tmp_path, caplog):
    src = write(tmp_path / "d.de", "a\n\nc\nd\n")
    tgt = write(tmp_path / "d.en", "A\nB\n  \nD\n")
    with caplog.at_level(logging.WARNING):
        s, t, stats = read_parallel(src, tgt)
    assert (s, t) == (["a", "d"], ["A", "D"])
    assert stats == {"lines": 4, "dropped_empty": 2, "pairs": 2}
    assert "dropped 2 of 4" in caplog.text


def test_fits_counts_eos_bos():
    # max_positions=4 leaves room for 3 tokens + EOS (source) / BOS + 3 tokens (target).
    assert fits(np.array([3, 4, 1, 0], dtype=np.uint16), 4).tolist() == [True, False, True, True]


def test_a_directory_is_not_called_missing(tmp_path):
    (tmp_path / "train.de").mkdir()
    with pytest.raises(CorpusError, match=r"train\.de: is a directory, not a corpus file"):
        read_lines(tmp_path / "train.de")
    with pytest.raises(CorpusError, match="is a directory"):
        scan(tmp_path / "train.de")


def test_byte_order_mark_is_dropped(tmp_path):
    src = write(tmp_path / "bom.de", "\ufeffErste\nzweite\n")
    tgt = write(tmp_path / "bom.en", "\ufeffFirst\nsecond\n")
    assert read_lines(src) == ["Erste", "zweite"]
    assert read_parallel(src, tgt)[1] == ["First", "second"]  # not "\ufeffFirst": BLEU would count it
    raw = LineReader(tgt).take(10)
    assert decode_lines(raw[2], tgt, raw[0], raw[1]) == ["First", "second"]


TRICKY = ("\ufeffeins\r\n\nzwei \u2028 drei\n\n \t \nvier" + "".join(f"\nz{i} {'x' * (i % 50)}" for i in range(3000)))


@pytest.mark.parametrize("final_newline", [True, False])
@pytest.mark.parametrize("gz", [False, True])
def test_streaming_reader_equals_read_lines(tmp_path, monkeypatch, gz, final_newline):
    monkeypatch.setattr(corpus, "_BLOCK", 97)  # lines straddle block ends
    data = (TRICKY + ("\n" if final_newline else "")).encode()
    path = tmp_path / "t.txt"
    path.write_bytes(gzip.compress(data[:5000]) + gzip.compress(data[5000:]) if gz else data)  # 2 gzip members
    expected = read_lines(path)
    got = []
    with LineReader(path) as r:
        while chunk := r.take(123):
            first, offset, raw = chunk
            if not raw:
                break
            assert first == len(got) + 1
            got += decode_lines(raw, path, first, offset)
    assert got == expected
    info = scan(path)
    assert info.lines == len(expected) and info.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_streaming_names_the_line_and_offset_of_bad_utf8(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_BLOCK", 7)
    good = "".join(f"line {i}\n" for i in range(50))
    bad = write(tmp_path / "bad.de", good.encode() + b"dri\xfftte\n")
    with LineReader(bad) as r, pytest.raises(CorpusError) as e:
        while (chunk := r.take(8))[2]:
            decode_lines(chunk[2], bad, chunk[0], chunk[1])
    assert f"{bad}:51: invalid UTF-8 byte 0xff at byte offset {len(good) + 3} (byte 3 of the line)" in str(e.value)


def test_corrupt_gzip_is_named(tmp_path):
    gz = tmp_path / "cut.de.gz"
    gz.write_bytes(gzip.compress(("ein Satz\n" * 5000).encode())[:-30])
    with pytest.raises(CorpusError, match=r"cut\.de\.gz: corrupt gzip file"):
        scan(gz)


@pytest.mark.parametrize("gz", [False, True])
def test_a_binary_file_is_named_by_its_first_nul_byte(tmp_path, gz):
    """A binary file (here text, then bytes with a NUL on line 3) is "not a text corpus", at the
    line of its first NUL byte, before any line count is compared (it was "line counts differ")."""
    import gzip

    data = b"ein satz\nnoch einer\nab\x00\x01\xff\ncd\n"
    path = tmp_path / ("b.de.gz" if gz else "b.de")
    path.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(CorpusError, match=rf"b\.de(\.gz)?:3: a NUL byte: not a text corpus \(a binary file\?\)$"):
        scan(path)


def test_an_all_blank_training_corpus_says_so(tmp_path):
    from normlab.data.preprocess import preprocess

    files = {}
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            (tmp_path / f"{split}.{lang}").write_text("\n \n\n" if split == "train" else "hallo welt\n")
        files[split] = (tmp_path / f"{split}.de", tmp_path / f"{split}.en")
    with pytest.raises(CorpusError, match=r"^empty corpus: every line pair of .*train\.de / .*train\.en has an "
                                          r"empty side \(no text to learn a vocabulary from\)$"):
        preprocess(files, tmp_path / "out")
    assert not (tmp_path / "out").exists()
