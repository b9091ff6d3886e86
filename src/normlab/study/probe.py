"""Probe studies (`kind: probe`): a measurement at initialisation instead of training. Today one
probe, Liu et al. 2020's output change: for each arm (a ModelConfig variant), depth and seed, the
change ‖F(x;W) − F(x;W*)‖ of the encoder and decoder outputs under W* = W − 1e-4·sign(N(0,1))
(normlab.probes), on one fixed batch of the bundled training data, and relative to ‖F(x;W)‖.

Each (arm, seed) is one record, like a training run's: `change_{encoder,decoder}_N<n>`,
`relative_{encoder,decoder}_N<n>`, `ratio_{encoder,decoder}` = change at N_max / change at N_min,
and `growth_{encoder,decoder}`: the least-squares slope of log(change) on log(N) over every depth,
i.e. the exponent k of change ~ N^k. O(N) growth has k = 1; O(log N) growth has a local exponent
1 / ln N, 0.3-0.5 over 2..36 layers; a bounded change has k ~ 0. A slope over all depths is less
noisy per seed than the two end points alone.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from pathlib import Path

from normlab.study.damaged import is_damaged, read_results
from normlab.study.spec import Arm, Study

METRICS_VERSION = 2  # 2: growth is the log-log slope over every depth (1: log of the end points' ratio)


def probe_identity(study: Study, arm: Arm, seed: int) -> str:
    text = json.dumps({"probe": study.probe, "model": arm.model, "seed": seed, "metrics": METRICS_VERSION},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def batches(n: int, max_tokens: int, extra: list[str]):
    from hydra.utils import instantiate

    from normlab.study.plan import compose

    cfg = compose([f"data.max_tokens={max_tokens}", *extra])
    dm = instantiate(cfg.data)
    dm.setup("fit")
    return dm.tokenizer, list(itertools.islice(iter(dm.train_dataloader()), n))


def measure(study: Study, arm: Arm, seed: int, tok, probe_batch, profile) -> dict:
    """The record's metrics for one arm and seed at every depth."""
    import torch

    from normlab.config import ModelConfig
    from normlab.init.admin import profile_omega_
    from normlab.model.transformer import Seq2SeqTransformer
    from normlab.probes import output_change

    p = study.probe
    d = int(p.get("d_model", 128))
    out: dict = {}
    for n in p["depths"]:
        torch.manual_seed(seed)
        cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=d, encoder_layers=n, decoder_layers=n,
                          encoder_heads=4, decoder_heads=4, encoder_ffn=4 * d, decoder_ffn=4 * d,
                          pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id, **(arm.model or {}))
        model = Seq2SeqTransformer(cfg)
        if cfg.init == "admin":  # ω profiled on two other training batches, as a run would
            profile_omega_(model, profile, tok.pad_id)
        change = output_change(model, probe_batch["src"], probe_batch["tgt_in"], delta=1e-4, seed=seed)
        size = output_norms(model, probe_batch["src"], probe_batch["tgt_in"])
        for side in ("encoder", "decoder"):
            out[f"change_{side}_N{n}"] = change[side]
            out[f"relative_{side}_N{n}"] = change[side] / size[side]
    lo, hi = min(p["depths"]), max(p["depths"])
    for side in ("encoder", "decoder"):
        ys = [out[f"change_{side}_N{n}"] for n in p["depths"]]
        out[f"ratio_{side}"] = ys[-1] / ys[0] if ys[0] > 0 else None
        out[f"growth_{side}"] = loglog_slope(p["depths"], ys)
    return out


def loglog_slope(depths: list[int], ys: list[float]) -> float | None:
    """k of y ~ N^k: least squares of log y on log N."""
    if len(depths) < 2 or min(ys) <= 0:
        return None
    x = [math.log(n) for n in depths]
    y = [math.log(v) for v in ys]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def output_norms(model, src, tgt_in) -> dict[str, float]:
    """‖F(x;W)‖ over the real tokens, the scale the change is measured against."""
    import torch

    with torch.no_grad():
        model.eval()
        memory, pad = model.encode(src)
        dec = model.decoder(tgt_in, memory, pad)
    return {"encoder": memory[~pad].norm().item(), "decoder": dec[tgt_in.ne(model.cfg.pad_id)].norm().item()}


def run_probe(study: Study, out: Path, say=print) -> int:
    """Measure every (arm, seed) without a record of the same identity; write its record."""
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    todo = []
    for seed in study.seeds:
        for arm in study.arms.values():
            rec = out / "runs" / f"{arm.name}-s{seed}"
            ident = probe_identity(study, arm, seed)
            done = rec / "results.json"
            if is_damaged(done, record=True):  # named once, left as it is (study/damaged.py): not measured over
                continue
            if (read_results(done, record=True) or {}).get("identity_hash") == ident:
                continue
            todo.append((arm, seed, rec, ident))
    say(f"study {study.name} ({study.budget}): {len(study.arms) * len(study.seeds)} probes, {len(todo)} to run")
    if not todo:
        return 0
    tok, (probe_batch, *profile) = batches(3, int(study.probe.get("max_tokens", 1024)), list(study.budget_overrides))
    import time

    for arm, seed, rec, ident in todo:
        t0 = time.time()
        metrics = measure(study, arm, seed, tok, probe_batch, profile)
        metrics["wall_s"] = round(time.time() - t0, 1)
        rec.mkdir(parents=True, exist_ok=True)
        res = {"status": "completed", "identity_hash": ident, "seed": seed, **metrics,
               "study": {"name": study.name, "arm": arm.name, "seed": seed, "budget": study.budget}}
        tmp = rec / ".results.json.tmp"
        tmp.write_text(json.dumps(res, indent=2) + "\n")
        os.replace(tmp, rec / "results.json")
        say(f"done  {arm.name} seed {seed}: growth encoder {metrics['growth_encoder']:.3f}, "
            f"decoder {metrics['growth_decoder']:.3f}")
    return 0


def depth_table(study: Study, by_arm: dict, side: str, relative: bool = False) -> list[str]:
    """Mean ± sd over seeds of the change at each depth, and the sd as a share of the mean: how far
    one seed's perturbation draw moves a cell."""
    import numpy as np

    key = "relative" if relative else "change"
    arms = list(study.arms.values())
    lines = ["| N (enc = dec) | " + " | ".join(a.label for a in arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for n in study.probe["depths"]:
        cells = []
        for a in arms:
            vals = [r.results.get(f"{key}_{side}_N{n}") for r in by_arm.get(a.name, [])]
            vals = [v for v in vals if v is not None]
            if not vals:
                cells.append("—")
                continue
            m, sd = float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
            cells.append(f"{m:.4f} ± {sd:.4f} ({100 * sd / m:.0f}%)" if m else f"{m:.4f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def depth_plot(study: Study, by_arm: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    depths = study.probe["depths"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for ax, side in zip(axes, ("encoder", "decoder")):
        for i, a in enumerate(study.arms.values()):
            recs = by_arm.get(a.name, [])
            if not recs:
                continue
            vals = np.array([[r.results.get(f"change_{side}_N{n}", np.nan) for n in depths] for r in recs])
            ax.errorbar(depths, np.nanmean(vals, 0), yerr=np.nanstd(vals, 0), marker="os^vD<>ph*XP"[i % 12], ms=4,
                        capsize=2, ls="-" if i < 10 else "--", label=a.label)
        ax.set_yscale("log")
        ax.set_xlabel("layers per stack (N)")
        ax.set_ylabel("‖F(x;W) − F(x;W*)‖ (mean ± sd over seeds)")
        ax.set_title(f"output change at init, {side} output", fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(out / "output_change.png", dpi=100)
    plt.close(fig)
    return "output_change.png"


def shape_lines(study: Study, by_arm: dict) -> list[str]:
    """Linear in N or in ln N? Least-squares R² of both fits on the seed-mean curve of each arm
    (Liu et al.: post-LN O(N), pre-LN / Admin O(log N)), and y(N_max) / y(N_min)."""
    import numpy as np

    depths = np.array(study.probe["depths"], dtype=float)
    if len(depths) < 3:
        return []

    def r2(x, y):
        a, b = np.polyfit(x, y, 1)
        resid = y - (a * x + b)
        return 1 - resid.var() / y.var() if y.var() > 0 else float("nan")

    lines = ["| arm | encoder: R² linear / R² ln N | encoder y(max)/y(min) | decoder: R² linear / R² ln N | "
             "decoder y(max)/y(min) |", "|---|---|---|---|---|"]
    for a in study.arms.values():
        recs = by_arm.get(a.name, [])
        if not recs:
            continue
        cells = []
        for side in ("encoder", "decoder"):
            y = np.array([np.mean([r.results[f"change_{side}_N{int(n)}"] for r in recs]) for n in depths])
            lin, log = r2(depths, y), r2(np.log(depths), y)
            best = "linear" if lin > log else "ln N"
            cells += [f"{lin:.2f} / {log:.2f} ({best})", f"{y[-1] / y[0]:.2f}"]
        lines.append(f"| {a.label} | " + " | ".join(cells) + " |")
    return lines
