"""Output change at initialisation vs depth for post-norm, pre-norm and Admin (Liu et al. 2020).

    .venv/bin/python experiments/norm_depth/output_change.py            # ~2 CPU-minutes
Writes output_change.md (table) and output_change.png next to this file. Each cell: mean over
seeds of ‖F(x;W) − F(x;W*)‖ with W* = W − 1e-4·sign(N(0,1)) (normlab.probes), on one fixed batch
of the bundled de-en training data (the cached default tokenizer), N encoder = N decoder layers.
Admin: ω profiled on two other training batches (init=admin, mode profile), as a run would.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from normlab.config import ModelConfig
from normlab.init.admin import profile_omega_
from normlab.model.transformer import Seq2SeqTransformer
from normlab.probes import output_change

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VARIANTS = {"post-norm": ("post", "xavier"), "pre-norm": ("pre", "xavier"), "Admin": ("post", "admin")}


def batches(n: int, max_tokens: int):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"data.max_tokens={max_tokens}"])
    dm = instantiate(cfg.data)
    dm.setup("fit")
    return dm.tokenizer, list(itertools.islice(iter(dm.train_dataloader()), n))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="2,4,6,8,12,18,24,30,36")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the CPU is shared
    tok, (probe, *profile) = batches(3, args.max_tokens)
    depths = [int(d) for d in args.depths.split(",")]
    rows = {v: {} for v in VARIANTS}
    for v, (placement, init) in VARIANTS.items():
        for n in depths:
            enc, dec = [], []
            for seed in range(1, args.seeds + 1):
                torch.manual_seed(seed)
                cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=args.d_model, encoder_layers=n,
                                  decoder_layers=n, encoder_heads=4, decoder_heads=4,
                                  encoder_ffn=4 * args.d_model, decoder_ffn=4 * args.d_model,
                                  pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
                                  init=init, norm={"placement": placement})
                model = Seq2SeqTransformer(cfg)
                if init == "admin":
                    profile_omega_(model, profile, tok.pad_id)
                c = output_change(model, probe["src"], probe["tgt_in"], delta=1e-4, seed=seed)
                enc.append(c["encoder"])
                dec.append(c["decoder"])
            rows[v][n] = (sum(enc) / len(enc), sum(dec) / len(dec))
            print(f"{v:10s} N={n:3d}  encoder {rows[v][n][0]:.4f}  decoder {rows[v][n][1]:.4f}", flush=True)
    write(rows, depths, args)


def write(rows, depths, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"Output change ‖F(x;W) − F(x;W*)‖ at init, d_model={args.d_model}, mean of {args.seeds} seeds "
             f"(encoder / decoder output). Command: `.venv/bin/python experiments/norm_depth/output_change.py`", "",
             "| layers (enc = dec) | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
    for n in depths:
        lines.append(f"| {n} | " + " | ".join(f"{rows[v][n][0]:.4f} / {rows[v][n][1]:.4f}" for v in VARIANTS) + " |")
    (HERE / "output_change.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, k, title in ((axes[0], 0, "encoder output"), (axes[1], 1, "decoder output")):
        for v in VARIANTS:
            ax.plot(depths, [rows[v][n][k] for n in depths], marker="o", label=v)
        ax.set_xlabel("layers per stack (N)")
        ax.set_ylabel("‖F(x;W) − F(x;W*)‖")
        ax.set_title(f"Output change at init, {title}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "output_change.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
