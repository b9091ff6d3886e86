"""Score a checkpoint with sacreBLEU and chrF (with their signatures), as training does.

    python -m normlab.commands.evaluate RUN_OR_CKPT --split test                 # data config of the run
    python -m normlab.commands.evaluate RUN_OR_CKPT --split valid --beam 1       # greedy
    python -m normlab.commands.evaluate RUN_OR_CKPT --src test.de --ref test.en --output scores.json

With --split, the split's files, batching and length limits come from the run folder's
`.hydra/config.yaml` (data group) and the tokenizer from the checkpoint, so the batches are the
ones training scored (normlab.evaluation.translate_batches + score: one code path). The scores
are printed and written as JSON (default: <run>/eval/<checkpoint>.<split>.beam<k>.json, with the
hypotheses beside it as .hyp); existing files are only replaced with --force.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm

from normlab.checkpoint import atomic_write_bytes, write_json
from normlab.commands.common import (CommandError, CommandParser, load, main_guard, parse_decoding_command,
                                     refuse_overwrite, run_dir_of_checkpoint)
from normlab.config import ConfigError
from normlab.data.corpus import CorpusError, read_lines
from normlab.evaluation import lines_loader, make_decoder, ordered, score, translate_batches


def split_batches(run_dir: Path, split: str, tokenizer, owner: str):
    """(batches, references, sources) of a split, as the run's data module builds them (from the
    same memory-mapped arrays; `owner` names where `tokenizer` comes from, for the error when the
    data was encoded with another one)."""
    from normlab.data.datamodule import TranslationDataModule

    cfg_path = run_dir / ".hydra" / "config.yaml"
    if not cfg_path.is_file():
        raise CommandError(f"{cfg_path} not found: --split needs the run folder's Hydra config; "
                           "use --src/--ref for other files")
    data = OmegaConf.to_container(OmegaConf.load(cfg_path).data, resolve=True)
    data.pop("_target_", None)
    dm = TranslationDataModule(**data, tokenizer=tokenizer, tokenizer_owner=owner)
    try:
        dm.setup("test")
    except (CorpusError, ConfigError) as e:
        raise CommandError(str(e)) from None
    return dm.dataloader(split), dm.references(split), dm.sources(split)


def evaluate(model, tokenizer, batches, references: list[str], decoder: dict, progress: bool = False) -> dict:
    t0 = time.perf_counter()
    batches = tqdm(batches, unit="batch", disable=not progress, file=sys.stderr)
    hyps = ordered(translate_batches(model, batches, make_decoder(**decoder), tokenizer.decode), len(references))
    seconds = time.perf_counter() - t0
    return {**score(hyps, references), "sentences": len(references), "decode_seconds": round(seconds, 2),
            "decoder": decoder, "hypotheses": hyps}


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(prog="python -m normlab.commands.evaluate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("checkpoint", help="a checkpoint (.ckpt) or a run folder (its best, else last, checkpoint)")
    ap.add_argument("--split", choices=("valid", "test"), help="a split of the run's data config")
    ap.add_argument("--src", help="source file (plain or .gz), instead of --split")
    ap.add_argument("--ref", help="reference file, line-aligned with --src")
    ap.add_argument("--output", "-o", help="JSON file for the scores (default: <run>/eval/<ckpt>.<split>.beam<k>.json)")
    ap.add_argument("--hyp-output", help="where to write the hypotheses (default: the JSON path with .hyp)")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    args, decoder = parse_decoding_command(ap, argv, max_tokens=8192)
    if bool(args.split) == bool(args.src or args.ref) or bool(args.src) != bool(args.ref):
        raise CommandError("give either --split, or both --src and --ref")
    model, tok, ckpt_path = load(args.checkpoint, args.device)
    run_dir = run_dir_of_checkpoint(ckpt_path)
    name = args.split or Path(args.src).name
    out = Path(args.output or run_dir / "eval" / f"{ckpt_path.stem}.{name}.beam{args.beam}.json")
    hyp_out = Path(args.hyp_output or out.with_suffix(".hyp"))
    refuse_overwrite(out, hyp_out, force=args.force)
    if args.split:
        batches, refs, _ = split_batches(run_dir, args.split, tok, str(ckpt_path))
    else:
        try:
            srcs, refs = read_lines(args.src), read_lines(args.ref)
        except CorpusError as e:
            raise CommandError(str(e)) from None
        if len(srcs) != len(refs):
            raise CommandError(f"{args.src} has {len(srcs)} lines but {args.ref} has {len(refs)}")
        batches, _ = lines_loader(tok, srcs, model.cfg.max_positions, args.max_tokens)
    result = evaluate(model, tok, batches, refs, decoder, progress=not args.quiet)
    hyps = result.pop("hypotheses")
    result.update(checkpoint=str(ckpt_path), split=args.split, src=args.src, ref=args.ref, hypotheses_file=str(hyp_out))
    atomic_write_bytes(hyp_out, lambda f: f.write("".join(h + "\n" for h in hyps).encode("utf-8")))
    write_json(out, result)
    print(json.dumps(result, indent=2, sort_keys=True))
    print(f"BLEU {result['bleu']}  chrF {result['chrf']}  ({result['bleu_signature']})  -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_guard(main))
