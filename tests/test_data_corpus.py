"""Corpus reading: every malformed input fails with CorpusError naming file and line."""
import gzip
import logging

import pytest

from normlab.data.corpus import CorpusError, filter_by_length, read_lines, read_parallel, truncate


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


def test_filter_by_length_counts_eos_bos(caplog):
    # max_positions=4 leaves room for 3 tokens + EOS (source) / BOS + 3 tokens (target).
    src = [[5, 6, 7], [5, 6, 7, 8], [5], [5]]
    tgt = [[9], [9], [9, 9, 9], [9, 9, 9, 9]]
    with caplog.at_level(logging.WARNING):
        keep, dropped = filter_by_length(src, tgt, max_positions=4, name="toy")
    assert keep == [0, 2] and dropped == 2
    assert "toy: dropped 2 of 4" in caplog.text


def test_truncate_keeps_every_pair():
    out, n = truncate([[1, 2, 3, 4, 5], [1, 2]], max_positions=4)
    assert out == [[1, 2, 3], [1, 2]] and n == 1
