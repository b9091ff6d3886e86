"""Output change at initialisation vs depth for every residual / normalization scheme (Liu et al.
2020's probe; the schemes of README "Residual and normalization schemes").

    .venv/bin/python experiments/norm_depth/output_change.py            # every scheme, 2..36 layers
    .venv/bin/python experiments/norm_depth/output_change.py --variants post-norm,DeepNorm --seeds 1
Writes <out>.md (table), <out>_relative.md and <out>.png next to this file (--out, default
output_change). Each cell: mean over seeds of ‖F(x;W) − F(x;W*)‖ with W* = W − 1e-4·sign(N(0,1))
(normlab.probes), on one fixed batch of the bundled de-en training data (the cached default
tokenizer), N encoder = N decoder layers; the relative table divides by ‖F(x;W)‖, because not every
scheme ends its stacks in a norm (ReZero has none, DyT is bounded, ResiDual adds two streams).
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
# name -> ModelConfig options (the arms of conf/arm/)
VARIANTS = {
    "post-norm": {"norm": {"placement": "post"}},
    "pre-norm": {"norm": {"placement": "pre"}},
    "Admin": {"norm": {"placement": "post"}, "init": "admin"},
    "ScaleNorm+FixNorm": {"norm": {"placement": "pre", "type": "scalenorm", "fixnorm": True}},
    "DeepNorm": {"norm": {"placement": "deepnorm"}},
    "Sub-LN": {"norm": {"placement": "subln"}},
    "Sandwich": {"norm": {"placement": "sandwich"}},
    "ReZero": {"norm": {"placement": "rezero", "type": "none"}},
    "ResiDual": {"norm": {"placement": "resi_dual"}},
    "DyT (pre)": {"norm": {"placement": "pre", "type": "dyt"}},
    "DLCL (pre)": {"norm": {"placement": "pre"}, "layer_aggregation": "dlcl"},
    "DLCL (post)": {"norm": {"placement": "post"}, "layer_aggregation": "dlcl"},
}


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
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    ap.add_argument("--out", default="output_change", help="file name stem of the tables and the plot")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown[0]!r} (allowed: {', '.join(VARIANTS)})")
    torch.set_num_threads(1)  # the CPU is shared
    tok, (probe, *profile) = batches(3, args.max_tokens)
    depths = [int(d) for d in args.depths.split(",")]
    rows = {v: {} for v in names}
    for v in names:
        for n in depths:
            enc, dec, rel_enc, rel_dec = [], [], [], []
            for seed in range(1, args.seeds + 1):
                torch.manual_seed(seed)
                cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=args.d_model, encoder_layers=n,
                                  decoder_layers=n, encoder_heads=4, decoder_heads=4,
                                  encoder_ffn=4 * args.d_model, decoder_ffn=4 * args.d_model,
                                  pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id, **VARIANTS[v])
                model = Seq2SeqTransformer(cfg)
                if cfg.init == "admin":
                    profile_omega_(model, profile, tok.pad_id)
                c = output_change(model, probe["src"], probe["tgt_in"], delta=1e-4, seed=seed)
                size = output_norms(model, probe["src"], probe["tgt_in"])
                enc.append(c["encoder"])
                dec.append(c["decoder"])
                rel_enc.append(c["encoder"] / size["encoder"])
                rel_dec.append(c["decoder"] / size["decoder"])
            rows[v][n] = tuple(sum(x) / len(x) for x in (enc, dec, rel_enc, rel_dec))
            print(f"{v:18s} N={n:3d}  encoder {rows[v][n][0]:.4f}  decoder {rows[v][n][1]:.4f}", flush=True)
    write(rows, depths, args)


@torch.no_grad()
def output_norms(model, src, tgt_in) -> dict[str, float]:
    """‖F(x;W)‖ over the real tokens, the scale output_change's difference is measured against."""
    model.eval()
    memory, pad = model.encode(src)
    dec = model.decoder(tgt_in, memory, pad)
    return {"encoder": memory[~pad].norm().item(), "decoder": dec[tgt_in.ne(model.cfg.pad_id)].norm().item()}


def table(rows, depths, names, k: int, title: str) -> list[str]:
    lines = [title, "", "| layers (enc = dec) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for n in depths:
        lines.append(f"| {n} | " + " | ".join(f"{rows[v][n][k]:.4f} / {rows[v][n][k + 1]:.4f}" for v in names) + " |")
    return lines


def write(rows, depths, args) -> None:
    names = list(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    how = (f"d_model={args.d_model}, mean of {args.seeds} seeds (encoder / decoder output). Command: "
           f"`.venv/bin/python experiments/norm_depth/output_change.py --d-model {args.d_model} --seeds {args.seeds}"
           f" --out {args.out}`")
    lines = table(rows, depths, names, 0, f"Output change ‖F(x;W) − F(x;W*)‖ at init, {how}")
    rel = table(rows, depths, names, 2, f"Relative output change ‖F(x;W) − F(x;W*)‖ / ‖F(x;W)‖ at init, {how}")
    (HERE / f"{args.out}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (HERE / f"{args.out}_relative.md").write_text("\n".join(rel) + "\n", encoding="utf-8")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex=True)
    markers = "os^vD<>ph*XP"
    for (row, col), k, what in (((0, 0), 0, "encoder"), ((0, 1), 1, "decoder"), ((1, 0), 2, "encoder"),
                                ((1, 1), 3, "decoder")):
        ax = axes[row, col]
        for i, v in enumerate(names):
            ax.plot(depths, [rows[v][n][k] for n in depths], marker=markers[i % len(markers)], ms=4,
                    ls="-" if i < 10 else "--", label=v)
        ax.set_ylabel("‖ΔF‖" if row == 0 else "‖ΔF‖ / ‖F‖")
        ax.set_title(f"{'Relative output' if row else 'Output'} change at init, {what} output", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_yscale("log")
    for ax in axes[1]:
        ax.set_xlabel("layers per stack (N)")
    axes[0, 1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(HERE / f"{args.out}.png", dpi=110)
    print("\n".join(lines + [""] + rel))


if __name__ == "__main__":
    sys.exit(main())
