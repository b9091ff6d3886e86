"""Preprocess a parallel corpus once into a data folder that every run, rank and command memory-maps.

    python -m normlab.commands.preprocess --trainpref wmt14/train --validpref wmt14/valid \\
        --testpref wmt14/test --src-lang en --tgt-lang de --vocab-size 32000 --out data-bin/wmt14_en_de
    python -m normlab.commands.preprocess --train a.de a.en --valid b.de b.en --test c.de c.en \\
        --out data-bin/mine --spm-model runs/x/tokenizer/spm.model      # reuse a tokenizer
    python train.py data=preprocessed data.path=data-bin/wmt14_en_de

Inputs are plain or gzip text, one sentence per line, line-aligned (a PREFIX.LANG file, or
PREFIX.LANG.gz if that does not exist). Sentencepiece is trained on at most --spm-sample lines
drawn with --spm-seed (0: every line), or --spm-model is reused; pairs with an empty side are
dropped and counted; --workers processes encode the corpus. The folder appears only when complete
(written next to it under a temporary name, then renamed); an existing one is replaced only with
--force. Training-length limits (max_positions) are applied when a run loads it.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

# No torch here, not even through normlab.commands.common: the encoding processes are spawned and
# import this module again (as __mp_main__), and the command should start in a fraction of a second.
from normlab.errors import CommandParser, UserError
from normlab.data.preprocess import SPLITS, SpmSettings, check_replaceable, preprocess

PROG = "python -m normlab.commands.preprocess"


def _prefixed(prefix: str, lang: str) -> str:
    plain = f"{prefix}.{lang}"
    return plain if os.path.exists(plain) or not os.path.exists(plain + ".gz") else plain + ".gz"


class UsageError(UserError):
    """A bad flag: printed as `error: ...`, exit code 2."""


def input_files(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    files = {}
    for split in SPLITS:
        pair, prefix = getattr(args, split), getattr(args, f"{split}pref")
        if bool(pair) == bool(prefix):
            raise UsageError(f"give --{split} SRC TGT or --{split}pref PREFIX (with --src-lang/--tgt-lang)")
        if prefix and not (args.src_lang and args.tgt_lang):
            raise UsageError(f"--{split}pref needs --src-lang and --tgt-lang (files PREFIX.LANG)")
        files[split] = tuple(pair) if pair else (_prefixed(prefix, args.src_lang), _prefixed(prefix, args.tgt_lang))
    return files


def _positive(flag: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise UsageError(f"{flag}={value} must be >= {minimum}")


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    g = ap.add_argument_group("inputs")
    for split in SPLITS:
        g.add_argument(f"--{split}", nargs=2, metavar=("SRC", "TGT"), help=f"{split} source and target files")
        g.add_argument(f"--{split}pref", metavar="PREFIX", help=f"{split} files PREFIX.SRC_LANG and PREFIX.TGT_LANG")
    g.add_argument("--src-lang", help="source language code (file suffix with --*pref; stored in the manifest)")
    g.add_argument("--tgt-lang", help="target language code")
    ap.add_argument("--out", "--destdir", required=True, help="the data folder to write")
    ap.add_argument("--name", help="corpus name stored in the manifest (default: the folder's name)")
    t = ap.add_argument_group("tokenizer")
    t.add_argument("--spm-model", help="reuse this sentencepiece model instead of training one")
    t.add_argument("--vocab-size", type=int, default=8000, help="joint vocabulary (default: 8000)")
    t.add_argument("--spm-model-type", choices=("bpe", "unigram"), default="bpe", help="(default: bpe)")
    t.add_argument("--character-coverage", type=float, default=1.0, help="(default: 1.0)")
    t.add_argument("--spm-sample", type=int, default=1_000_000,
                   help="train on at most this many lines, source + target, drawn at random; 0 = all (default: 1000000)")
    t.add_argument("--spm-seed", type=int, default=1, help="seed of that draw (default: 1)")
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8),
                    help="encoding processes (default: the cores, at most 8)")
    ap.add_argument("--force", action="store_true", help="replace an existing folder")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    try:
        args = ap.parse_args(argv)
    except UserError as e:  # a bad flag: one line, as every command
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run(args, sys.argv[1:] if argv is None else argv)
    except UserError as e:  # a bad flag (UsageError) or corpus (CorpusError)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted; {args.out} was not written", file=sys.stderr)
        return 130


def run(args: argparse.Namespace, argv: list[str]) -> int:
    files = input_files(args)
    _positive("--workers", args.workers)
    _positive("--vocab-size", args.vocab_size, 5)
    _positive("--spm-sample", args.spm_sample, 0)
    if not 0 < args.character_coverage <= 1:
        raise UsageError(f"--character-coverage={args.character_coverage} must be in (0, 1]")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise UsageError(f"{out}: exists; pass --force to replace it")
    if out.exists():  # before any work: --force never deletes what preprocess did not write
        check_replaceable(out, [p for pair in files.values() for p in pair])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from normlab.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(args.spm_model) if args.spm_model else None
    spm = SpmSettings(args.vocab_size, args.spm_model_type, args.character_coverage, args.spm_sample, args.spm_seed)
    manifest = preprocess(files, out, spm, tokenizer, workers=args.workers, progress=not args.quiet,
                          command=shlex.join([*PROG.split(), *argv]), name=args.name or out.name,
                          src_lang=args.src_lang or "src", tgt_lang=args.tgt_lang or "tgt", force=args.force)
    print(summary(manifest, out))
    return 0


def summary(manifest: dict, out: Path) -> str:
    lines = []
    for split, s in manifest["splits"].items():
        lines.append(f"{split:5s} {s['pairs']:>11,} pairs  {s['tokens']['src']:>13,} + {s['tokens']['tgt']:>13,} tokens"
                     f"  dropped: {s['dropped']['empty']:,} with an empty side")
    train = manifest["splits"]["train"]
    nbytes = sum(spec["bytes"] for name, spec in manifest["arrays"].items() if name.startswith("train."))
    sec = manifest["seconds"]
    lines.append(f"train arrays: {nbytes / train['pairs']:.1f} bytes per pair ({manifest['token_dtype']} tokens); "
                 f"{sum(s['lines'] for s in manifest['splits'].values()) / max(sec['encode'], 1e-9):,.0f} pairs/s "
                 "encoding; "
                 f"seconds: scan {sec['scan']}, tokenizer {sec['tokenizer']}, encode {sec['encode']}")
    lines.append(f"-> {out}\nuse it: python train.py data=preprocessed data.path={out}")
    return "\n".join(lines)


def cli() -> None:
    """Console script entry point (normlab-preprocess)."""
    raise SystemExit(main())


if __name__ == "__main__":
    cli()
