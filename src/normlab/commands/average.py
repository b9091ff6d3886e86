"""Average the parameters of several checkpoints into one (fairseq's average_checkpoints.py).

    python -m normlab.commands.average RUN_DIR --last 5                       # -> RUN_DIR/checkpoints/avg-last5.ckpt (avg-lastK: K found)
    python -m normlab.commands.average RUN_DIR --last 5 --output avg.ckpt
    python -m normlab.commands.average a.ckpt b.ckpt c.ckpt --output avg.ckpt

--last N takes the N latest step<N>.ckpt files of a run (by step; training writes them every
callbacks.step_checkpoints.every_n_steps and keeps callbacks.step_checkpoints.keep_last_n). Checkpoints of
different architectures (model_config, parameter names or shapes, tokenizer) are refused. The
output loads with normlab.checkpoint.load_model and the translate / evaluate commands; an
existing output is only replaced with --force.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from normlab.averaging import CheckpointMismatch, average_checkpoints, last_checkpoints, save_checkpoint
from normlab.checkpoint import CheckpointError, load_checkpoint
from normlab.commands.common import CommandError, CommandParser, main_guard, refuse_overwrite


def _averages(output: Path, paths: list[Path]) -> bool:
    """Whether `output` already is the average of exactly these checkpoints (by name: training and
    the command may see the run folder under different relative paths)."""
    try:
        done = load_checkpoint(output, mmap=True).get("averaged_from") or []
    except CheckpointError:
        return False
    return sorted(Path(p).name for p in done) == sorted(p.name for p in paths)


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(prog="python -m normlab.commands.average", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("inputs", nargs="+", help="one run folder (with --last), or two or more checkpoint files")
    ap.add_argument("--last", type=int, help="average the last N step checkpoints of the run folder")
    ap.add_argument("--output", "-o", help="output checkpoint (default with --last: <run>/checkpoints/avg-lastN.ckpt)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output")
    args = ap.parse_args(argv)
    if args.last is not None:
        if len(args.inputs) != 1 or not Path(args.inputs[0]).is_dir():
            raise CommandError("--last N takes exactly one run folder")
        try:
            paths = last_checkpoints(args.inputs[0], args.last)
        except (FileNotFoundError, ValueError) as e:
            raise CommandError(args.inputs[0], str(e)) from None
        if len(paths) < args.last:
            print(f"warning: only {len(paths)} step checkpoints found, averaging those")
        ckdir = paths[-1].parent
        output = Path(args.output or ckdir / f"avg-last{len(paths)}.ckpt")  # named by what it averages
    else:
        paths = [Path(p) for p in args.inputs]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise CommandError(f"not a checkpoint file: {', '.join(missing)} (use --last N for a run folder)")
        if not args.output:
            raise CommandError("--output is required when averaging a list of checkpoints")
        output = Path(args.output)
    if not args.force and output.is_file() and _averages(output, paths):
        # training writes <run>/checkpoints/avg-lastN.ckpt of the same files: nothing to redo
        print(json.dumps({"output": str(output), "averaged_from": [str(p) for p in paths],
                          "note": "already the average of these checkpoints; left as it is"}, indent=2))
        return 0
    refuse_overwrite(output, force=args.force)
    try:
        averaged = average_checkpoints(paths)
    except CheckpointMismatch as e:
        raise CommandError(f"cannot average: {e}") from None
    save_checkpoint(averaged, output)
    print(json.dumps({"output": str(output), "averaged_from": averaged["averaged_from"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main_guard(main))
