"""A corpus the run refuses is one line (issue 37 item 8), as `python train.py` prints it: `error:
<file[:line]>: <what>`, exit status 2 and nothing before it (no `tokens per update`, no preprocessing
line: the data is checked before the run says what it will do), no run folder, nothing in the cache.
One case per way a corpus is refused, from text files (the cache) and from a preprocessed folder."""
import gzip
import shutil
from pathlib import Path

import pytest

from conftest import refused, tiny_overrides

pytestmark = pytest.mark.integration


def _copy(corpus: dict[str, str], to: Path) -> dict[str, str]:
    to.mkdir()
    files = {k: str(to / Path(v).name) for k, v in corpus.items()}
    for k, v in corpus.items():
        shutil.copy(v, files[k])
    return files


def _lines(path: str) -> list[bytes]:
    return Path(path).read_bytes().splitlines()


def _write(path: str, lines: list[bytes]) -> None:
    Path(path).write_bytes(b"".join(line + b"\n" for line in lines))


def _missing(f, tmp):
    f["train_src"] = str(tmp / "nope.de")
    return [], f"error: {tmp / 'nope.de'}: corpus file not found"


def _folder(f, tmp):
    (tmp / "adir").mkdir()
    f["valid_tgt"] = str(tmp / "adir")
    return [], f"error: {tmp / 'adir'}: is a directory, not a corpus file"


def _line_counts(f, tmp):
    _write(f["test_tgt"], _lines(f["test_tgt"])[:-1])
    return [], f"error: line counts differ: {f['test_src']} has 40 lines, {f['test_tgt']} has 39"


def _empty(f, tmp):
    for k in ("valid_src", "valid_tgt"):
        Path(f[k]).write_bytes(b"")
    return [], f"error: empty corpus: {f['valid_src']} and {f['valid_tgt']} have no lines"


def _blank(f, tmp):
    _write(f["train_src"], [b" "] * len(_lines(f["train_src"])))
    return [], f"error: empty corpus: every line pair of {f['train_src']} / {f['train_tgt']} has an empty side"


def _not_utf8(f, tmp):
    lines = _lines(f["train_tgt"])
    _write(f["train_tgt"], lines[:-1] + [b"caf\xe9"])
    offset = sum(len(line) + 1 for line in lines[:-1]) + 3
    return [], (f"error: {f['train_tgt']}:{len(lines)}: invalid UTF-8 byte 0xe9 at byte offset {offset} "
                "(byte 3 of the line)")


def _cut_gzip(f, tmp):
    data = gzip.compress(Path(f["train_src"]).read_bytes())
    f["train_src"] = str(tmp / "train.de.gz")
    Path(f["train_src"]).write_bytes(data[: len(data) // 2])
    return [], f"error: {f['train_src']}: corrupt gzip file (compressed file ended before the end-of-stream marker)"


def _binary(f, tmp):
    lines = _lines(f["test_src"])
    _write(f["test_src"], lines[:2] + [b"\0\x01\x02"] + lines[3:])
    return [], f"error: {f['test_src']}:3: a NUL byte: not a text corpus (a binary file?)"


def _vocab(f, tmp):
    n = sum(1 for k in ("train_src", "train_tgt") for line in _lines(f[k]) if line.strip())
    return ["data.vocab_size=100000"], (f"error: {f['train_src']}: sentencepiece cannot train on its {n} sampled "
                                        "training lines: ")


def _max_positions(f, tmp):
    return ["model.max_positions=2"], "error: model.max_positions=2 drops every one of the 600 training pairs of "


TEXT_CASES = {"missing file": _missing, "a folder": _folder, "line counts differ": _line_counts,
              "empty split": _empty, "every pair has an empty side": _blank, "not UTF-8": _not_utf8,
              "cut-off gzip": _cut_gzip, "binary file": _binary, "vocabulary too large": _vocab,
              "max_positions drops every pair": _max_positions}


@pytest.mark.parametrize("case", TEXT_CASES)
def test_a_refused_text_corpus_is_one_line(case, small_corpus, tmp_path):
    files = _copy(small_corpus, tmp_path / "corpus")
    extra, expected = TEXT_CASES[case](files, tmp_path)
    cache, run = tmp_path / "cache", tmp_path / "run"
    # in this process but the first case, which runs train.py as a user does (conftest.refused)
    line = refused([*tiny_overrides(files, run, cache), *extra], tmp_path, here=case != "missing file")
    assert line.startswith(expected), line
    assert not run.exists()
    entries = list((cache / "data").iterdir()) if (cache / "data").exists() else []  # no lock file left
    if case == "max_positions drops every pair":  # the corpus is sound: its entry serves other settings
        assert [(e / "manifest.json").is_file() for e in entries] == [True]
    else:
        assert entries == []


@pytest.fixture(scope="module")
def data_folder(small_corpus, tmp_path_factory) -> Path:
    from normlab.data.preprocess import SpmSettings, preprocess

    out = tmp_path_factory.mktemp("bin") / "folder"
    files = {s: (small_corpus[f"{s}_src"], small_corpus[f"{s}_tgt"]) for s in ("train", "valid", "test")}
    preprocess(files, out, SpmSettings(vocab_size=300))
    return out


def _folder_args(path: Path, run: Path, corpus: dict) -> list[str]:
    model = [a for a in tiny_overrides(corpus, run, run.parent / "cache") if not a.startswith("data.")]
    return ["data=preprocessed", f"data.path={path}", "data.max_tokens=512", *model]


def test_a_missing_data_folder_is_one_line_whose_command_runs(small_corpus, tmp_path):
    """The hint is a preprocess command that writes the folder (it named a `--train-src` flag that
    the command does not have)."""
    from normlab.commands import preprocess

    missing = tmp_path / "none"
    line = refused(_folder_args(missing, tmp_path / "run", small_corpus), tmp_path)
    assert line.startswith(f"error: {missing}: data folder not found (run: python -m normlab.commands.preprocess "), \
        line
    assert not (tmp_path / "run").exists()
    argv = line.split("(run: python -m normlab.commands.preprocess ", 1)[1].removesuffix(")").split()
    files = iter(small_corpus[f"{split}_{side}"] for split in ("train", "valid", "test") for side in ("src", "tgt"))
    argv = [next(files) if a in ("SRC", "TGT") else a for a in argv]
    assert preprocess.main([*argv, "--vocab-size", "300", "--workers", "1", "--quiet"]) == 0
    assert (missing / "manifest.json").is_file()


@pytest.mark.parametrize("case", ["no manifest", "truncated array", "vocab_size differs"])
def test_a_refused_data_folder_is_one_line(case, data_folder, small_corpus, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(data_folder, folder)
    extra = []
    if case == "no manifest":
        (folder / "manifest.json").unlink()
        expected = (f"error: {folder / 'manifest.json'}: not found, so {folder} is not a complete preprocessed data "
                    "folder")
    elif case == "truncated array":
        array = folder / "train.src.tokens"
        size = array.stat().st_size
        array.write_bytes(array.read_bytes()[: size // 2])
        expected = f"error: {array}: truncated ({size // 2} bytes, the manifest says {size})"
    else:
        extra = ["data.vocab_size=999"]
        expected = f"error: data.vocab_size=999, but the tokenizer of {folder} has 300 pieces"
    line = refused([*_folder_args(folder, tmp_path / "run", small_corpus), *extra], tmp_path, here=True)
    assert line.startswith(expected), line
    assert not (tmp_path / "run").exists()
