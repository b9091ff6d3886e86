"""A preprocessed data folder, checked before anything reads it; and the cache that the text data
configs (data=bible_de_en, data=custom) preprocess into on first use.

Checked on every open (cheap: stat and one small file): the manifest's format version; every
array and text file present with exactly the manifest's byte size (a truncated or missing file is
named); spm.model's sha256; and, with check_inputs, each input file that still exists at its
recorded path: same size and mtime, or else the same sha256 (a touched but unchanged file passes,
an edited one is an error). Nothing here re-encodes a user's folder: a problem is a CorpusError
that names the file and the command that rebuilds it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import asdict
from functools import cached_property
from pathlib import Path

from normlab.data.arrays import KINDS, TokenArray
from normlab.data.corpus import CorpusError, check_file
from normlab.data.preprocess import FORMAT_VERSION, MANIFEST, SIDES, SPLITS, SpmSettings, preprocess
from normlab.data.tokenizer import MODEL_FILE, Tokenizer
from normlab.json_file import json_kind

log = logging.getLogger(__name__)

PREPROCESS = "python -m normlab.commands.preprocess"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class DataFolder:
    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest
        self.built = False  # preprocessed by this process just now (cached_folder), said once the run accepts it

    @classmethod
    def open(cls, path: str | Path, check_inputs: bool = True) -> "DataFolder":
        path = Path(path)
        generic = f"(run: {PREPROCESS} --train SRC TGT --valid SRC TGT --test SRC TGT --out {path})"
        if not path.is_dir():
            what = "not a folder" if path.exists() else "data folder not found"
            raise CorpusError(f"{path}: {what} {generic}")
        mf = path / MANIFEST
        if not mf.is_file():
            raise CorpusError(f"{mf}: not found, so {path} is not a complete preprocessed data folder {generic}")
        try:
            manifest = json.loads(mf.read_text())
        except (OSError, ValueError) as e:
            raise CorpusError(f"{mf}: unreadable ({e}) {generic}") from None
        if not isinstance(manifest, dict):
            raise CorpusError(f"{mf}: {json_kind(manifest)}, not a JSON object {generic}")
        folder = cls(path, manifest)
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CorpusError(f"{mf}: data folder format {manifest.get('format_version')!r}, this normlab reads "
                              f"{FORMAT_VERSION} {folder.rebuild}")
        try:
            folder._check_files()
            if check_inputs:
                folder._check_inputs()
        except (KeyError, TypeError, AttributeError) as e:  # a manifest edited by hand or cut short
            raise CorpusError(f"{mf}: incomplete or malformed ({type(e).__name__}: {e}) {folder.rebuild}") from None
        return folder

    @property
    def rebuild(self) -> str:
        """What to run when the folder is damaged or stale."""
        command = self.manifest.get("command")
        if not command:  # a cache entry: normlab rebuilds it when it is gone
            return f"(run: rm -r {self.path}; the next run rebuilds it)"
        return f"(run: {command}{'' if ' --force' in command else ' --force'})"

    def _check_files(self) -> None:
        sizes = {**{name: spec["bytes"] for name, spec in self.manifest["arrays"].items()},
                 **{name: spec["bytes"] for name, spec in self.manifest["texts"].items()}}
        for name, expected in sizes.items():
            f = self.path / name
            if not f.is_file():
                raise CorpusError(f"{f}: missing {self.rebuild}")
            actual = f.stat().st_size
            if actual != expected:
                what = "truncated" if actual < expected else "larger than written"
                raise CorpusError(f"{f}: {what} ({actual} bytes, the manifest says {expected}) {self.rebuild}")
        model = self.path / MODEL_FILE
        if not model.is_file() or sha256_file(model) != self.manifest["tokenizer"]["sha256"]:
            what = "missing" if not model.is_file() else "differs from the one the arrays were encoded with"
            raise CorpusError(f"{model}: {what} {self.rebuild}")

    def _check_inputs(self) -> None:
        for key, rec in self.manifest["inputs"].items():
            p = Path(rec["path"])
            try:
                st = p.stat()
            except OSError:  # moved or deleted: the folder stands on its own
                continue
            if st.st_size == rec["size"] and st.st_mtime_ns == rec["mtime_ns"]:
                continue
            if st.st_size != rec["size"] or sha256_file(p) != rec["sha256"]:
                raise CorpusError(
                    f"{self.path / MANIFEST}: input {key} ({p}) has changed since the folder was written "
                    f"({'size' if st.st_size != rec['size'] else 'sha256'} differs) {self.rebuild[:-1]}, "
                    "or set data.check_inputs=false to use the folder as it is)")

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.path / MODEL_FILE)

    def check_tokenizer(self, tokenizer: Tokenizer, owner: str, fix: str) -> None:
        if tokenizer.sha256 != self.manifest["tokenizer"]["sha256"]:
            raise CorpusError(f"{self.path / MODEL_FILE}: differs from the tokenizer of {owner}, so the token ids "
                              f"would mean other words (run: {fix})")

    def arrays(self, split: str) -> tuple[TokenArray, TokenArray]:
        specs = self.manifest["arrays"]
        return tuple(TokenArray.open({kind: (self.path / f"{split}.{side}.{kind}", specs[f"{split}.{side}.{kind}"])
                                      for kind in KINDS}) for side in SIDES)

    def text(self, split: str, side: str) -> list[str]:
        """The stripped lines of a held-out split, one per pair (what BLEU is computed against)."""
        return (self.path / f"{split}.{side}.txt").read_bytes().decode("utf-8").removesuffix("\n").split("\n")

    @property
    def name(self) -> str:
        return self.manifest.get("name") or self.path.name


# -- the cache of the text data configs ------------------------------------------------------------
def _key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def _locked(path: Path):
    """One builder per cache entry on this machine (DDP ranks started by torchrun or SLURM, jobs of
    a sweep); elsewhere the atomic rename keeps concurrent builders safe, only wasteful. The lock
    file is removed by its holder, built or not (a rejected corpus leaves nothing in the cache); a
    waiter that then locks the removed file only re-checks the manifest, and two builders are safe."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            try:
                os.unlink(path)  # while held
            except OSError:
                pass
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_folder(files: dict[str, tuple[str | Path, str | Path]], cache_dir: Path, spm: SpmSettings,
                  name: str, src_lang: str, tgt_lang: str, tokenizer: Tokenizer | None = None,
                  workers: int | None = None, progress: bool = False) -> DataFolder:
    """The folder preprocessed from these files, built on first use. Keyed by the inputs' paths,
    sizes and mtimes and by the tokenizer settings (or, for a given tokenizer, by its sha256), so an
    edited input or a changed setting gets a new folder and a run seed never does."""
    inputs = {}
    for split in SPLITS:
        for side, p in zip(SIDES, files[split]):
            p = check_file(p).resolve()
            st = p.stat()
            inputs[f"{split}.{side}"] = [str(p), st.st_size, st.st_mtime_ns]
    root = Path(cache_dir) / "data"
    import sentencepiece

    # another sentencepiece release may segment differently
    base = {"format": FORMAT_VERSION, "inputs": inputs, "sentencepiece": sentencepiece.__version__}
    folder = root / f"{name}-{_key({**base, 'spm': asdict(spm)})}"
    if tokenizer is not None and not _has_tokenizer(folder, tokenizer):
        folder = root / f"{name}-{_key({**base, 'tokenizer_sha256': tokenizer.sha256})}"
    built = False
    with _locked(root / f".{folder.name}.lock"):
        if not (folder / MANIFEST).is_file():
            if workers is None:  # worker processes pay off from a few hundred thousand pairs
                small = sum(os.path.getsize(p) for p in files["train"]) < 50 << 20
                workers = 1 if small else min(os.cpu_count() or 1, 8)
            # Nothing is logged here: the run says what was built once it has accepted the data
            # (datamodule.setup), so a corpus it refuses, here or after, is the one error line.
            # force only replaces a folder without a manifest (never written by preprocess); a
            # builder on another machine that published first is kept
            preprocess(files, folder, spm, tokenizer, workers=workers, progress=progress, name=name,
                       src_lang=src_lang, tgt_lang=tgt_lang, force=folder.exists(), own_cache=True)
            built = True
    out = DataFolder.open(folder, check_inputs=False)  # the key already covers the inputs
    out.built = built
    return out


def built_line(folder: DataFolder) -> str:
    """What preprocessing into the cache did, for the run's log."""
    tok = folder.manifest["tokenizer"]
    made = (f"a {tok['settings']['model_type']} tokenizer of {tok['vocab_size']} pieces trained on "
            f"{tok['sample_lines']:,} lines" if tok["trained"] else f"the tokenizer of {tok['given']}")
    return (f"{folder.name}: preprocessed into {folder.path} in {sum(folder.manifest['seconds'].values()):.1f} s, "
            f"{made} (once; later runs reuse it)")


def _has_tokenizer(folder: Path, tokenizer: Tokenizer) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text())["tokenizer"]["sha256"] == tokenizer.sha256
    except (OSError, ValueError, KeyError):
        return False
