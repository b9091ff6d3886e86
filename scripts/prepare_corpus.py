#!/usr/bin/env python
"""Turn locally downloaded IWSLT14 / WMT14 release files into the plain parallel text normlab reads.

normlab never downloads data. Fetch the release yourself, unpack it, and run one of:

    # IWSLT14 de-en (the `de-en.tgz` of the IWSLT 2014 evaluation campaign, unpacked):
    python scripts/prepare_corpus.py iwslt14 path/to/de-en data/iwslt14_de_en
    # WMT14 en-de (unpacked training-parallel-*.tgz files and the dev/test sgm files):
    python scripts/prepare_corpus.py wmt14 path/to/wmt14 data/wmt14_en_de --src en --tgt de
    # any other pair already split into aligned plain-text files:
    python scripts/prepare_corpus.py plain --train a.de a.en --valid b.de b.en --test c.de c.en out/ --src de --tgt en

Each writes OUT/{train,valid,test}.{src,tgt} (raw, untokenised, one sentence per line: the
joint BPE is learned by normlab from these files) and prints the `python train.py data=custom ...`
command that uses them, and the preprocess command for a large corpus. The splits follow fairseq's prepare-iwslt14.sh / prepare-wmt14en2de.sh:
IWSLT14 valid = every 23rd training pair (held out), test = tst2010-2012 + dev2010 of TED;
WMT14 valid = newstest2013, test = newstest2014 (full, 3003 sentences).
"""
from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

SEG = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)
WMT14_TRAIN = ("europarl-v7.de-en", "commoncrawl.de-en", "news-commentary-v9.de-en")


def read_tags_file(path: Path) -> list[str]:
    """IWSLT `train.tags.*`: drop metadata lines (they start with '<'), keep the text lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if not line.lstrip().startswith("<")]


def read_sgm(path: Path) -> list[str]:
    """IWSLT xml / WMT sgm: the text of every <seg> element, in order."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = SEG.search(line)
        if m:
            out.append(html.unescape(m.group(1)).strip())
    return out


def read_plain(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]


def clean_pairs(src: list[str], tgt: list[str], where: str) -> tuple[list[str], list[str]]:
    if len(src) != len(tgt):
        raise SystemExit(f"error: {where}: {len(src)} source vs {len(tgt)} target lines")
    kept = [(s, t) for s, t in zip(src, tgt) if s and t]
    return [s for s, _ in kept], [t for _, t in kept]


def write_split(out: Path, split: str, src: str, tgt: str, pair: tuple[list[str], list[str]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for lang, lines in zip((src, tgt), pair):
        (out / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{split}: {len(pair[0]):,} pairs")


def iwslt14(root: Path, src: str, tgt: str) -> dict:
    lp = f"{src}-{tgt}" if (root / f"train.tags.{src}-{tgt}.{src}").exists() else f"{tgt}-{src}"
    train = clean_pairs(read_tags_file(root / f"train.tags.{lp}.{src}"),
                        read_tags_file(root / f"train.tags.{lp}.{tgt}"), f"{root}/train.tags.{lp}")
    # fairseq's prepare-iwslt14.sh: valid = every 23rd training line, train = the rest.
    valid = ([s for i, s in enumerate(train[0]) if i % 23 == 0], [t for i, t in enumerate(train[1]) if i % 23 == 0])
    train = ([s for i, s in enumerate(train[0]) if i % 23], [t for i, t in enumerate(train[1]) if i % 23])
    test_src, test_tgt = [], []
    for name in ("IWSLT14.TED.dev2010", "IWSLT14.TED.tst2010", "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012"):
        s, t = read_sgm(root / f"{name}.{lp}.{src}.xml"), read_sgm(root / f"{name}.{lp}.{tgt}.xml")
        s, t = clean_pairs(s, t, f"{root}/{name}")
        test_src += s
        test_tgt += t
    return {"train": train, "valid": valid, "test": (test_src, test_tgt)}


def wmt14(root: Path, src: str, tgt: str) -> dict:
    train_src, train_tgt = [], []
    for corpus in WMT14_TRAIN:
        s = next(root.rglob(f"{corpus}.{src}"), None)
        t = next(root.rglob(f"{corpus}.{tgt}"), None)
        if s is None or t is None:
            raise SystemExit(f"error: {corpus}.{src}/.{tgt} not found below {root}")
        s, t = clean_pairs(read_plain(s), read_plain(t), corpus)
        train_src += s
        train_tgt += t

    def sgm(name: str) -> tuple[list[str], list[str]]:
        s = next(root.rglob(f"{name}-src.{src}.sgm"), None) or next(root.rglob(f"{name}*{src}*.sgm"), None)
        t = next(root.rglob(f"{name}-ref.{tgt}.sgm"), None) or next(root.rglob(f"{name}*{tgt}*.sgm"), None)
        if s is None or t is None:
            raise SystemExit(f"error: {name} sgm files for {src}/{tgt} not found below {root}")
        return clean_pairs(read_sgm(s), read_sgm(t), name)

    return {"train": (train_src, train_tgt), "valid": sgm("newstest2013"), "test": sgm("newstest2014")}


def plain(args) -> dict:
    return {split: clean_pairs(read_plain(Path(p[0])), read_plain(Path(p[1])), f"{p[0]} / {p[1]}")
            for split, p in (("train", args.train), ("valid", args.valid), ("test", args.test))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    for kind, (s, t) in (("iwslt14", ("de", "en")), ("wmt14", ("en", "de")), ("plain", ("src", "tgt"))):
        p = sub.add_parser(kind)
        if kind != "plain":
            p.add_argument("root", type=Path, help="the unpacked release folder")
        else:
            for split in ("train", "valid", "test"):
                p.add_argument(f"--{split}", nargs=2, required=True, metavar=("SRC", "TGT"))
        p.add_argument("out", type=Path)
        p.add_argument("--src", default=s)
        p.add_argument("--tgt", default=t)
    args = ap.parse_args(argv)
    if args.kind != "plain" and not args.root.is_dir():
        raise SystemExit(f"error: {args.root} is not a folder")
    splits = {"iwslt14": lambda: iwslt14(args.root, args.src, args.tgt),
              "wmt14": lambda: wmt14(args.root, args.src, args.tgt), "plain": lambda: plain(args)}[args.kind]()
    for split, pair in splits.items():
        write_split(args.out, split, args.src, args.tgt, pair)
    o, s, t = args.out.resolve(), args.src, args.tgt
    print("\ntrain on it with:\n  python train.py data=custom " + " ".join(
        f"data.{split}_{side}={o}/{split}.{lang}" for split in ("train", "valid", "test")
        for side, lang in (("src", s), ("tgt", t))) + f" data.src_lang={s} data.tgt_lang={t}")
    print(f"or, for a large corpus, preprocess it once (docs/data.md, \"Large corpora\"):\n"
          f"  python -m normlab.commands.preprocess --trainpref {o}/train --validpref {o}/valid --testpref {o}/test "
          f"--src-lang {s} --tgt-lang {t} --out {o}-bin\n  python train.py data=preprocessed data.path={o}-bin")


if __name__ == "__main__":
    sys.exit(main())
