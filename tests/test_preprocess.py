"""Preprocessing into a data folder: round trip, manifest, sampling, atomic writes under failure,
and the one-line errors for damaged or stale folders."""
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from normlab.commands import preprocess as cli
from normlab.config import ConfigError
from normlab.data import folder as folder_mod
from normlab.data import preprocess as pp
from normlab.data.arrays import ArrayWriter, TokenArray, token_dtype
from normlab.data.corpus import CorpusError, read_lines
from normlab.data.datamodule import TranslationDataModule
from normlab.data.folder import DataFolder, cached_folder
from normlab.data.preprocess import SpmSettings, sample_training_lines
from normlab.data.tokenizer import Tokenizer

from conftest import ROOT

SPM = SpmSettings(vocab_size=300)


@pytest.fixture(scope="module")
def texts(small_corpus, tmp_path_factory):
    """small_corpus with a pair whose target is blank, a BOM before the first valid reference,
    and the training source gzipped."""
    out = tmp_path_factory.mktemp("texts")
    files = {}
    for key, path in small_corpus.items():
        text = Path(path).read_text(encoding="utf-8")
        if key == "train_tgt":
            lines = text.split("\n")
            lines[5] = "   "
            text = "\n".join(lines)
        if key == "valid_tgt":
            text = "\ufeff" + text
        p = out / Path(path).name
        if key == "train_src":
            p = p.with_suffix(p.suffix + ".gz")
            p.write_bytes(gzip.compress(text.encode()))
        else:
            p.write_text(text, encoding="utf-8")
        files[key] = str(p)
    return files


def split_files(texts):
    return {s: (texts[f"{s}_src"], texts[f"{s}_tgt"]) for s in ("train", "valid", "test")}


@pytest.fixture(scope="module")
def built(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "bin"
    manifest = pp.preprocess(split_files(texts), out, SPM, command=f"python -m normlab.commands.preprocess --out {out}")
    return out, manifest


def fresh_copy(built, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(built[0], dst)
    return dst


def test_round_trip_ids_are_the_tokenizers_encoding_of_the_text(texts, built):
    out, manifest = built
    data = DataFolder.open(out)
    tok = data.tokenizer
    for split in ("train", "valid", "test"):
        src_lines = [s.strip() for s in read_lines(texts[f"{split}_src"])]
        tgt_lines = [t.strip() for t in read_lines(texts[f"{split}_tgt"])]
        keep = [i for i, (s, t) in enumerate(zip(src_lines, tgt_lines)) if s and t]
        src, tgt = data.arrays(split)
        assert [src[i] for i in range(len(src))] == tok.encode([src_lines[i] for i in keep])
        assert [tgt[i] for i in range(len(tgt))] == tok.encode([tgt_lines[i] for i in keep])
        assert src.tokens.dtype == np.uint16 and isinstance(src.tokens, np.memmap)
        s = manifest["splits"][split]
        assert s["pairs"] == len(keep) and s["dropped"]["empty"] == len(src_lines) - len(keep)
        if split != "train":
            assert data.text(split, "src") == [src_lines[i] for i in keep]
            assert data.text(split, "tgt") == [tgt_lines[i] for i in keep]
    assert manifest["splits"]["train"]["dropped"]["empty"] == 1
    assert not data.text("valid", "tgt")[0].startswith("\ufeff")  # the BOM never reaches BLEU's references
    assert manifest["tokenizer"]["trained"] and manifest["tokenizer"]["sample_lines"] == 2 * 600 - 1
    assert manifest["inputs"]["train.src"]["path"] == str(Path(texts["train_src"]).resolve())


def test_worker_processes_write_the_same_bytes(texts, built, tmp_path, monkeypatch):
    monkeypatch.setattr(pp, "CHUNK", 64)  # several chunks per split, in flight at once
    out = tmp_path / "par"
    pp.preprocess(split_files(texts), out, SPM, workers=2)
    for name in built[1]["arrays"]:
        assert (out / name).read_bytes() == (built[0] / name).read_bytes(), name


def test_reused_tokenizer_and_int32_ids(texts, built, tmp_path):
    tok = DataFolder.open(built[0]).tokenizer
    manifest = pp.preprocess(split_files(texts), tmp_path / "given", tokenizer=tok)
    assert not manifest["tokenizer"]["trained"] and manifest["tokenizer"]["sha256"] == tok.sha256
    assert (tmp_path / "given" / "train.tgt.tokens").read_bytes() == (built[0] / "train.tgt.tokens").read_bytes()
    assert token_dtype(1 << 16) == np.uint16 and token_dtype((1 << 16) + 1) == np.int32
    writer = ArrayWriter(tmp_path / "big", np.dtype("<i4"))
    writer.append(np.array([70000, 5, 69999]), np.array([2, 1]))
    specs = writer.close()
    arr = TokenArray.open({k: (tmp_path / f"big.{k}", spec) for k, spec in specs.items()})
    assert [arr[0], arr[1]] == [[70000, 5], [69999]]


def test_sentencepiece_sample_is_bounded_and_reproducible(texts):
    train = split_files(texts)["train"]
    everything = sample_training_lines(train, (600, 600), 0, 1)
    assert everything == [line for f in train for line in read_lines(f) if line.strip()]
    assert sample_training_lines(train, (600, 600), 5000, 1) == everything  # a sample that covers all
    a = sample_training_lines(train, (600, 600), 100, 1)
    assert 95 <= len(a) <= 100 and set(a) <= set(everything)
    assert a == sample_training_lines(train, (600, 600), 100, 1)
    assert a != sample_training_lines(train, (600, 600), 100, 2)
    assert any(line in read_lines(train[1]) for line in a) and any(line in read_lines(train[0]) for line in a)


def test_an_exception_midway_leaves_no_folder(texts, tmp_path, monkeypatch):
    monkeypatch.setattr(pp, "CHUNK", 64)
    calls = []

    def interrupt(self, *a):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(ArrayWriter, "append", interrupt)
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess(split_files(texts), tmp_path / "bin", SPM)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary twin


KILL_MIDWAY = """
import os, signal, sys
from normlab.data import preprocess as pp
from normlab.data.arrays import ArrayWriter
real, calls = ArrayWriter.append, []
def append(self, *a):
    real(self, *a)
    calls.append(1)
    if len(calls) == 4:
        os.kill(os.getpid(), signal.SIGKILL)
ArrayWriter.append = append
pp.CHUNK = 64
files = {s: (sys.argv[1] + f"/{s}.de", sys.argv[1] + f"/{s}.en") for s in ("train", "valid", "test")}
pp.preprocess(files, sys.argv[2], pp.SpmSettings(vocab_size=300))
"""


def test_a_killed_preprocess_leaves_nothing_that_looks_complete(small_corpus, tmp_path):
    out = tmp_path / "bin"
    proc = subprocess.run([sys.executable, "-c", KILL_MIDWAY, str(Path(small_corpus["train_src"]).parent), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not out.exists()
    (partial,) = tmp_path.iterdir()  # the temporary folder SIGKILL left: hidden, no manifest
    assert partial.name.startswith(".bin.tmp-") and not (partial / "manifest.json").exists()
    assert any(partial.glob("train.src.tokens"))  # it was killed mid-encoding, not before
    with pytest.raises(CorpusError, match=f"{out}: data folder not found"):
        DataFolder.open(out)
    with pytest.raises(CorpusError, match="manifest.json: not found, so .* is not a complete preprocessed"):
        DataFolder.open(partial)
    files = {s: (small_corpus[f"{s}_src"], small_corpus[f"{s}_tgt"]) for s in ("train", "valid", "test")}
    pp.preprocess(files, out, SPM)  # a rerun completes
    assert DataFolder.open(out).manifest["splits"]["train"]["pairs"] == 600


def test_truncated_missing_or_replaced_files_are_named(built, tmp_path):
    data = fresh_copy(built, tmp_path)
    command = built[1]["command"]
    tokens = data / "train.src.tokens"
    size = tokens.stat().st_size
    with open(tokens, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CorpusError) as e:
        DataFolder.open(data)
    assert str(e.value) == (f"{tokens}: truncated ({size - 10} bytes, the manifest says {size}) "
                            f"(run: {command} --force)")
    tokens.unlink()
    with pytest.raises(CorpusError, match=f"{tokens}: missing"):
        DataFolder.open(data)
    shutil.copy(built[0] / "train.src.tokens", tokens)
    (data / "spm.model").write_bytes(Tokenizer.train(["ein Haus", "zwei Häuser"] * 50, 40).proto)
    with pytest.raises(CorpusError, match="spm.model: differs from the one the arrays were encoded with"):
        DataFolder.open(data)
    shutil.copy(built[0] / "spm.model", data / "spm.model")
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**manifest, "format_version": 0}))
    with pytest.raises(CorpusError, match="data folder format 0, this normlab reads 1"):
        DataFolder.open(data)
    (data / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "arrays"}))
    with pytest.raises(CorpusError, match=r"manifest\.json: incomplete or malformed \(KeyError: 'arrays'\)"):
        DataFolder.open(data)


def test_a_changed_input_makes_the_folder_stale(texts, tmp_path):
    inputs = tmp_path / "in"
    shutil.copytree(Path(texts["train_src"]).parent, inputs)
    files = {s: (str(inputs / Path(texts[f"{s}_src"]).name), str(inputs / Path(texts[f"{s}_tgt"]).name))
             for s in ("train", "valid", "test")}
    out = tmp_path / "bin"
    pp.preprocess(files, out, SPM, command="python -m normlab.commands.preprocess --out bin")
    test_tgt = Path(files["test"][1])
    os.utime(test_tgt, ns=(1, 1))  # touched, same bytes: still fresh (the sha256 decides)
    DataFolder.open(out)
    test_tgt.write_text(test_tgt.read_text().replace("the", "teh", 1))  # same size, new content
    with pytest.raises(CorpusError) as e:
        DataFolder.open(out)
    assert str(e.value) == (f"{out}/manifest.json: input test.tgt ({test_tgt}) has changed since the folder was "
                            "written (sha256 differs) (run: python -m normlab.commands.preprocess --out bin --force, "
                            "or set data.check_inputs=false to use the folder as it is)")
    DataFolder.open(out, check_inputs=False)
    test_tgt.unlink()  # inputs deleted after preprocessing: the folder stands on its own
    DataFolder.open(out)


def test_data_module_on_a_folder_rejects_another_tokenizer(built):
    other = Tokenizer.train(["ein Haus", "zwei Häuser", "drei"] * 50, 40)
    dm = TranslationDataModule(path=str(built[0]), tokenizer=other, tokenizer_owner="run/last.ckpt")
    with pytest.raises(CorpusError, match=r"spm\.model: differs from the tokenizer of run/last\.ckpt"):
        dm.setup("test")
    dm = TranslationDataModule(path=str(built[0]), max_positions=64, vocab_size=None)
    dm.setup("fit")
    assert dm.name == "bin" and dm.tokenizer.sha256 == built[1]["tokenizer"]["sha256"]
    with pytest.raises(ConfigError, match="data.vocab_size=8000, but the tokenizer of .* has 300 pieces"):
        TranslationDataModule(path=str(built[0]), vocab_size=8000).setup("fit")


def test_cache_is_reused_keyed_by_settings_and_built_once(texts, tmp_path, monkeypatch):
    calls = []
    real = folder_mod.preprocess

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(folder_mod, "preprocess", counting)
    files, cache = split_files(texts), tmp_path / "cache"
    build = lambda spm=SPM, tok=None: cached_folder(files, cache, spm, "toy", "de", "en", tok).path
    threads = [threading.Thread(target=build) for _ in range(3)]  # e.g. DDP ranks started together
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    base = build()
    assert len(calls) == 1 and base.parent == cache / "data" and base.name.startswith("toy-")
    given = DataFolder.open(base).tokenizer
    assert build(tok=given) == base and len(calls) == 1  # a checkpoint's tokenizer that matches: reused
    assert build(SpmSettings(vocab_size=280)) != base and len(calls) == 2
    assert build(SpmSettings(vocab_size=300, sample=50)) not in (base,) and len(calls) == 3
    other_tok = Tokenizer.train(read_lines(files["test"][1]) * 3, 200)
    assert build(tok=other_tok) not in (base,) and len(calls) == 4
    os.utime(files["test"][0], ns=(1, 1))
    assert build() != base and len(calls) == 5
    assert sorted(p.name for p in (cache / "data").iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in (cache / "data").iterdir() if p.is_dir())  # no temporary folders left


def run_cli(*args) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "normlab.commands.preprocess", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr


@pytest.mark.integration
def test_cli_writes_a_folder_train_can_use_and_errors_are_one_line(small_corpus, tmp_path):
    d = Path(small_corpus["train_src"]).parent
    out = tmp_path / "bin"
    base = ["--trainpref", d / "train", "--validpref", d / "valid", "--testpref", d / "test",
            "--src-lang", "de", "--tgt-lang", "en", "--vocab-size", 300, "-q"]
    assert cli.main([*map(str, base), "--out", str(out), "--workers", "1"]) == 0
    manifest = DataFolder.open(out).manifest
    assert manifest["src_lang"] == "de" and manifest["splits"]["train"]["pairs"] == 600
    assert manifest["command"].startswith("python -m normlab.commands.preprocess --trainpref")
    (tmp_path / "dir.de").mkdir()
    cases = [
        ([*base, "--out", out], f"error: {out}: exists; pass --force to replace it"),
        ([*base[:2], "--train", d / "train.de", d / "train.en", *base[2:], "--out", tmp_path / "x"],
         "error: give --train SRC TGT or --trainpref PREFIX (with --src-lang/--tgt-lang)"),
        (["--train", tmp_path / "dir.de", d / "train.en", *base[2:], "--out", tmp_path / "x"],
         f"error: {tmp_path / 'dir.de'}: is a directory, not a corpus file"),
        (["--train", d / "train.de", d / "valid.en", *base[2:], "--out", tmp_path / "x"],
         f"error: line counts differ: {d / 'train.de'} has 600 lines, {d / 'valid.en'} has 40"),
        ([*base, "--out", tmp_path / "x", "--spm-model", d / "train.de"],
         f"error: {d / 'train.de'}: not a sentencepiece model"),
        # argparse's own errors: one line too, not its usage block
        (base, f"error: {cli.PROG}: the following arguments are required: --out/--destdir (see {cli.PROG} --help)"),
        ([*base, "--out", tmp_path / "x", "--vocab-size", "abc"],
         f"error: {cli.PROG}: argument --vocab-size: invalid int value: 'abc'"),
        (["--train", d / "train.de"], f"error: {cli.PROG}: argument --train: expected 2 arguments"),
    ]
    for args, message in cases:
        rc, err = run_cli(*args)
        assert rc == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "dir.de"]  # the failures wrote nothing
    rc, err = run_cli(*base, "--out", out, "--force", "--vocab-size", 280)
    assert rc == 0 and DataFolder.open(out).tokenizer.vocab_size == 280


@pytest.mark.integration
def test_force_never_deletes_what_preprocess_did_not_write(small_corpus, tmp_path):
    """--force over the folder that holds the input corpus, over an unrelated folder or over a plain
    file: one error line, exit 2, every file still there (was: the inputs and a file beside them
    deleted); over a data folder preprocess wrote: replaced."""
    corpus = tmp_path / "corpus"
    shutil.copytree(Path(small_corpus["train_src"]).parent, corpus)
    (corpus / "notes.txt").write_text("mine")
    before = sorted(p.name for p in corpus.iterdir())
    base = ["--trainpref", corpus / "train", "--validpref", corpus / "valid", "--testpref", corpus / "test",
            "--src-lang", "de", "--tgt-lang", "en", "--vocab-size", 300, "-q", "--workers", 1, "--force"]
    code, err = run_cli(*base, "--out", corpus)
    assert code == 2 and err == (f"error: {corpus}: holds the input file {corpus / 'train.de'}; --force would "
                                 "delete it (write the data folder elsewhere)\n")
    assert sorted(p.name for p in corpus.iterdir()) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("keep")
    code, err = run_cli(*base, "--out", other)
    assert code == 2 and err.startswith(f"error: {other}: not a normlab data folder") and len(err.splitlines()) == 1
    assert (other / "keep.txt").read_text() == "keep"
    plain = tmp_path / "plain.bin"
    plain.write_text("data")
    code, err = run_cli(*base, "--out", plain)
    assert code == 2 and err.startswith(f"error: {plain}: is a file, not a data folder")
    assert plain.read_text() == "data" and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))  == []
    out = tmp_path / "bin"
    assert run_cli(*base, "--out", out)[0] == 0 and run_cli(*base, "--out", out)[0] == 0  # a data folder: replaced
    assert DataFolder.open(out).manifest["splits"]["train"]["pairs"] == 600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no .old / .tmp leftovers
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes a folder (was mkdtemp's 0700)


def test_every_file_is_synced_before_the_folder_is_published(small_corpus, tmp_path, monkeypatch):
    """spm.model, the references and the manifest are fsync'd, not only the arrays (issue 18)."""
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    d = Path(small_corpus["train_src"]).parent
    files = {s: (d / f"{s}.de", d / f"{s}.en") for s in ("train", "valid", "test")}
    pp.preprocess(files, tmp_path / "bin", SpmSettings(vocab_size=300))
    names = {Path(p).name for p in synced}
    written = {p.name for p in (tmp_path / "bin").iterdir()}
    assert written <= names, sorted(written - names)  # every file, the texts and the manifest included


@pytest.mark.integration
def test_a_vocabulary_sentencepiece_refuses_is_the_only_line(small_corpus, tmp_path):
    """No progress line before the refusal (was: `tokenizer: training bpe (vocab 100000) on ...`,
    then the error); the progress line comes once the tokenizer is trained."""
    d = Path(small_corpus["train_src"]).parent
    base = ["--trainpref", d / "train", "--validpref", d / "valid", "--testpref", d / "test",
            "--src-lang", "de", "--tgt-lang", "en", "--workers", 1]
    rc, err = run_cli(*base, "--vocab-size", 100000, "--out", tmp_path / "x")
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {d / 'train.de'}: sentencepiece cannot train on its ") and "Vocabulary size too " \
        "high (100000)" in err, err
    assert not (tmp_path / "x").exists()
    rc, err = run_cli(*base, "--vocab-size", 300, "--out", tmp_path / "y")
    assert rc == 0 and re.search(r"tokenizer: trained bpe \(vocab 300\) on \d+ lines in [\d.]+ s", err), err
