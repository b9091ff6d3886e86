"""Translate raw text with a trained checkpoint: one source sentence per line in, detokenised
translations out, in the input order.

    python -m normlab.commands.translate RUN_OR_CKPT < input.de > output.en
    python -m normlab.commands.translate RUN_OR_CKPT --input test.de --output test.en --beam 4 --lenpen 0.6
    python -m normlab.commands.translate RUN_OR_CKPT --input test.de --nbest 4   # index<TAB>score<TAB>text

Sentences are batched by length (--max-tokens), decoded with the cached beam search (greedy for
--beam 1) and written back in the input order. Sources longer than the model's max_positions are
cut (a warning says how many). An existing --output is only replaced with --force.
"""
from __future__ import annotations

import argparse
import logging
import sys

import torch
from tqdm import tqdm

from normlab.checkpoint import atomic_write_bytes
from normlab.commands.common import (CommandError, CommandParser, load, main_guard, parse_decoding_command,
                                     refuse_overwrite)
from normlab.data.corpus import CorpusError, read_lines
from normlab.decoding.beam import beam_search
from normlab.evaluation import lines_loader, make_decoder

log = logging.getLogger("normlab.translate")


@torch.no_grad()
def translate_lines(model, tokenizer, lines: list[str], decoder: dict, nbest: int = 1, max_tokens: int = 4096,
                    progress: bool = False) -> list[list[tuple[float | None, str]]]:
    """Per input line, its n-best list of (score, text), best first (score None for greedy); an
    empty (or blank) line gives an empty translation, as nothing was asked."""
    todo = [i for i, line in enumerate(lines) if line.strip()]
    out: list = [[(None, "")] for _ in lines]
    loader, n_cut = lines_loader(tokenizer, [lines[i] for i in todo], model.cfg.max_positions, max_tokens)
    if n_cut:
        log.warning("%d source lines cut to max_positions=%d tokens", n_cut, model.cfg.max_positions)
    decode = make_decoder(**decoder) if nbest == 1 else None
    device = next(model.parameters()).device
    with tqdm(total=len(todo), unit="sent", disable=not progress, file=sys.stderr) as bar:
        for batch in loader:
            src = batch["src"].to(device)
            if decode is not None:
                nbests = [[{"tokens": t, "score": None}] for t in decode(model, src)]
            else:
                nbests = beam_search(model, src, nbest=nbest, **decoder)
            for i, nb in zip(batch["idx"].tolist(), nbests):
                texts = tokenizer.decode([h["tokens"] for h in nb])
                out[todo[i]] = [(h["score"], text) for h, text in zip(nb, texts)]
            bar.update(len(nbests))
    return out


def format_output(results: list[list[tuple[float | None, str]]], nbest: int) -> str:
    if nbest == 1:
        return "".join(nb[0][1] + "\n" for nb in results)
    return "".join(f"{i}\t{'' if score is None else f'{score:.4f}'}\t{text}\n"
                   for i, nb in enumerate(results) for score, text in nb)


def _stdin_lines() -> list[str]:
    """UTF-8 text from stdin; binary input (NUL bytes, invalid UTF-8) is refused in one line."""
    data = sys.stdin.buffer.read()
    if b"\x00" in data or data[:2] == b"\x1f\x8b":
        raise CommandError("<stdin>", "binary input, not text (translate reads UTF-8 text, one sentence per "
                           "line; pass a .gz file with --input)")
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise CommandError(f"<stdin>:{line}", f"invalid UTF-8 byte 0x{data[e.start]:02x} "
                           "(translate reads UTF-8 text, one sentence per line)") from None
    # split("\n") as data.corpus.read_lines does: splitlines() would also break at U+2028, \x0c, ...
    if text.endswith("\n"):
        text = text[:-1]
    return [line.removesuffix("\r") for line in text.split("\n")] if text else []


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(prog="python -m normlab.commands.translate",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("checkpoint", help="a checkpoint (.ckpt) or a run folder (its best, else last, checkpoint)")
    ap.add_argument("--input", "-i", help="source text, one sentence per line (plain or .gz; default: stdin)")
    ap.add_argument("--output", "-o", help="where to write the translations (default: stdout)")
    ap.add_argument("--nbest", type=int, default=1,
                    help="hypotheses per sentence; > 1 writes index<TAB>score<TAB>text lines (default: 1)")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    args, decoder = parse_decoding_command(ap, argv)
    if not 1 <= args.nbest <= args.beam:
        raise CommandError(f"--nbest={args.nbest} must be between 1 and --beam={args.beam}")
    refuse_overwrite(args.output, force=args.force)
    try:
        lines = read_lines(args.input) if args.input else _stdin_lines()
    except CorpusError as e:
        raise CommandError(str(e)) from None
    nul = next((i for i, line in enumerate(lines) if "\x00" in line), None)
    if nul is not None:  # as on stdin: binary input is refused, not translated
        raise CommandError(f"{args.input}:{nul + 1}", "NUL byte: binary input, not text (translate reads UTF-8 "
                           "text, one sentence per line)")
    model, tok, _ = load(args.checkpoint, args.device)
    results = translate_lines(model, tok, lines, decoder, args.nbest, args.max_tokens,
                              progress=bool(args.input) and not args.quiet)
    text = format_output(results, args.nbest)
    if args.output:
        atomic_write_bytes(args.output, lambda f: f.write(text.encode("utf-8")))
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_guard(main))
