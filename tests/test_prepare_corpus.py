"""scripts/prepare_corpus.py: IWSLT14 release layout -> plain parallel text normlab reads."""
import importlib.util
from pathlib import Path

from normlab.data.corpus import read_parallel

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("prepare_corpus", ROOT / "scripts" / "prepare_corpus.py")
prep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prep)


def _xml(path: Path, segs: list[str]) -> None:
    body = "\n".join(f'<seg id="{i}"> {s} </seg>' for i, s in enumerate(segs, 1))
    path.write_text(f'<mteval>\n<doc docid="1">\n{body}\n</doc>\n</mteval>\n', encoding="utf-8")


def test_iwslt14_layout(tmp_path):
    root = tmp_path / "de-en"
    root.mkdir()
    de = [f"Satz {i}" for i in range(46)]
    en = [f"sentence {i}" for i in range(46)]
    meta = "<url>http://x</url>\n<keywords>talk</keywords>\n"
    (root / "train.tags.de-en.de").write_text(meta + "\n".join(de) + "\n", encoding="utf-8")
    (root / "train.tags.de-en.en").write_text(meta + "\n".join(en) + "\n", encoding="utf-8")
    for name in ("dev2010", "tst2010", "tst2011", "tst2012"):
        _xml(root / f"IWSLT14.TED.{name}.de-en.de.xml", [f"{name} de &amp; 1", f"{name} de 2"])
        _xml(root / f"IWSLT14.TED.{name}.de-en.en.xml", [f"{name} en & 1", f"{name} en 2"])
    out = tmp_path / "out"
    prep.main(["iwslt14", str(root), str(out)])
    train_de, train_en, _ = read_parallel(out / "train.de", out / "train.en")
    valid_de, valid_en, _ = read_parallel(out / "valid.de", out / "valid.en")
    test_de, test_en, _ = read_parallel(out / "test.de", out / "test.en")
    assert valid_de == ["Satz 0", "Satz 23"] and valid_en == ["sentence 0", "sentence 23"]  # every 23rd
    assert len(train_de) == 44 and "Satz 23" not in train_de and train_en[0] == "sentence 1"
    assert test_de[:2] == ["dev2010 de & 1", "dev2010 de 2"] and len(test_en) == 8
    assert test_en[2] == "tst2010 en & 1"


def test_plain_layout_rejects_misaligned_files(tmp_path, capsys):
    a, b = tmp_path / "a.de", tmp_path / "a.en"
    a.write_text("x\ny\n", encoding="utf-8")
    b.write_text("x\n", encoding="utf-8")
    import pytest

    with pytest.raises(SystemExit, match="2 source vs 1 target"):
        prep.main(["plain", "--train", str(a), str(b), "--valid", str(a), str(a), "--test", str(a), str(a),
                   str(tmp_path / "o")])
