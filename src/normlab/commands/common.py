"""What translate / evaluate / average share: decoder flags, loading, refusing to overwrite."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from normlab.checkpoint import CheckpointError, load_model, resolve_checkpoint
from normlab.errors import CommandParser, UserError, report, show_tracebacks, user_error_types  # noqa: F401 (re-export)
from normlab.model.attention import shape_free_sdpa


class CommandError(UserError):
    """A user error: printed as `error: ...` with exit code 2, no traceback."""


def add_decoder_args(ap: argparse.ArgumentParser) -> None:
    # Defaults are the papers' (Vaswani et al. 2017): beam 4, length penalty 0.6, |src| + 50.
    g = ap.add_argument_group("decoding")
    g.add_argument("--beam", type=int, default=4, help="beam size; 1 = greedy (default: 4)")
    g.add_argument("--lenpen", type=float, default=0.6,
                   help="GNMT length penalty alpha: score = log P / ((5+|Y|)/6)^alpha (default: 0.6)")
    g.add_argument("--max-len-a", type=float, default=1.0, help="max length = a * source length + b (default: 1)")
    g.add_argument("--max-len-b", type=int, default=50, help="(default: 50)")
    g.add_argument("--min-len", type=int, default=0, help="no EOS before this many tokens (default: 0)")


def decoder_kwargs(args: argparse.Namespace) -> dict:
    if args.beam < 1:
        raise CommandError(f"--beam={args.beam} must be >= 1")
    return {"beam": args.beam, "lenpen": args.lenpen, "max_len_a": args.max_len_a,
            "max_len_b": args.max_len_b, "min_len": args.min_len}


def add_runtime_args(ap: argparse.ArgumentParser, max_tokens: int | None = 4096) -> None:
    g = ap.add_argument_group("runtime")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    if max_tokens is not None:
        g.add_argument("--max-tokens", type=int, default=max_tokens,
                       help=f"source tokens per batch, padding included (default: {max_tokens})")
    g.add_argument("--force", action="store_true", help="overwrite existing output files")


def setup_runtime(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def parse_decoding_command(ap: argparse.ArgumentParser, argv: list[str] | None,
                           max_tokens: int | None = 4096) -> tuple[argparse.Namespace, dict]:
    """The decoding and runtime flags every decoding command shares; parse; (args, decoder kwargs)."""
    add_decoder_args(ap)
    add_runtime_args(ap, max_tokens=max_tokens)
    args = ap.parse_args(argv)
    setup_runtime(args)
    return args, decoder_kwargs(args)


def refuse_overwrite(*paths: str | os.PathLike | None, force: bool) -> None:
    for p in paths:
        if p is not None and Path(p).exists() and not force:
            raise CommandError(f"{p} exists; pass --force to overwrite it")


def load(checkpoint: str | os.PathLike, device: str = "cpu"):
    """(model on device in eval mode, tokenizer, checkpoint path) from a checkpoint or run folder."""
    path = resolve_checkpoint(checkpoint)
    model, tok = load_model(path)
    if tok is None:
        raise CheckpointError(str(path), "not a normlab checkpoint (no tokenizer_proto)")
    shape_free_sdpa(device)  # decoding changes shape every step: no per-shape cuDNN plans (model/attention.py)
    return model.to(device), tok, path


def run_dir_of_checkpoint(path: str | os.PathLike) -> Path:
    """The run folder of a checkpoint file (…/<run>/checkpoints/x.ckpt) or of a folder."""
    path = Path(path)
    if path.is_file():
        path = path.parent
    return path.parent if path.name == "checkpoints" else path


def main_guard(fn, argv=None) -> int:
    """Run a command's main: a user error (bad flag value, file, corpus or checkpoint) is one line
    `error: ...` on stderr and exit status 2; NORMLAB_TRACEBACK=1 shows its traceback."""
    try:
        return fn(argv)
    except user_error_types() as e:
        if show_tracebacks():
            raise
        return report(e)
