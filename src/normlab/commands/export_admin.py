"""Export an Admin checkpoint to a plain post-norm checkpoint (ω folded into the weights).

    python -m normlab.commands.export_admin CKPT_OR_RUN_DIR OUT.ckpt [--allow-inexact]

Exact where the fold is exact (normlab.init.admin: LayerNorm/RMSNorm with any vector ω, ScaleNorm
with a scalar ω, and ω_1 == 1 on the first sub-layer of each stack); otherwise it refuses and
lists the sub-layers, unless --allow-inexact. The output loads with normlab.checkpoint.load_model
and carries the tokenizer; the largest logit difference on a random batch is printed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from normlab.checkpoint import atomic_write_bytes, load_checkpoint, model_from_checkpoint, resolve_checkpoint
from normlab.commands.common import CommandError, CommandParser, main_guard
from normlab.init.admin import export_post_norm


@torch.no_grad()
def export_checkpoint(ckpt_path: str | Path, out: str | Path, allow_inexact: bool = False) -> dict:
    ckpt = load_checkpoint(resolve_checkpoint(ckpt_path))
    model = model_from_checkpoint(ckpt, ckpt_path)
    try:
        plain, report = export_post_norm(model, allow_inexact=allow_inexact)
    except ValueError as e:  # not an Admin model, or a fold that is not exact
        raise CommandError(str(ckpt_path), str(e)) from None
    g = torch.Generator().manual_seed(0)
    cfg = model.cfg
    src = torch.randint(3, cfg.vocab_size, (4, 12), generator=g)
    tgt = torch.randint(3, cfg.vocab_size, (4, 10), generator=g)
    report["max_abs_logit_diff"] = (plain.eval()(src, tgt) - model(src, tgt)).abs().max().item()
    saved = {"model_config": plain.cfg.to_dict(),
             "state_dict": {f"model.{k}": v for k, v in plain.state_dict().items()},
             "admin_export": report | {"source": str(ckpt_path)}}
    if "tokenizer_proto" in ckpt:
        saved["tokenizer_proto"] = ckpt["tokenizer_proto"]
    atomic_write_bytes(out, lambda f: torch.save(saved, f))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(prog="python -m normlab.commands.export_admin", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("checkpoint", help="an Admin checkpoint (.ckpt) or a run folder")
    ap.add_argument("out", help="where to write the plain post-norm checkpoint")
    ap.add_argument("--allow-inexact", action="store_true",
                    help="export an approximation where the fold is not exact (listed in the report)")
    args = ap.parse_args(argv)
    report = export_checkpoint(args.checkpoint, args.out, args.allow_inexact)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main_guard(main))
