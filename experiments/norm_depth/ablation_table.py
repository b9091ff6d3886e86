"""Table of the depth ablation from the sweep folders' results.json (one cell per arm × depth).

    .venv/bin/python experiments/norm_depth/ablation_table.py multirun/norm_depth/*
Cell: mean ± std (over seeds) of test BLEU and of test loss (label-smoothed CE per token); a run
with status "diverged" is counted apart, and a cell whose runs all diverged reads "diverged".
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

ARMS = {("postnorm", "xavier"): "post-norm", ("prenorm", "xavier"): "pre-norm",
        ("postnorm", "admin"): "Admin (post-norm)", ("scalenorm_fixnorm", "xavier"): "ScaleNorm+FixNorm (pre)"}


def runs(folders):
    for folder in folders:
        for res in sorted(Path(folder).glob("*/results.json")):
            r = json.loads(res.read_text())
            cfg = yaml.safe_load((res.parent / ".hydra" / "config.yaml").read_text())
            arm = ARMS.get((r["choices"].get("norm"), r["choices"].get("init")),
                           f"{r['choices'].get('norm')}/{r['choices'].get('init')}")
            yield arm, cfg["model"]["encoder_layers"], r


def fmt(values, digits):
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def main(folders) -> str:
    cells = defaultdict(list)
    for arm, depth, r in runs(folders):
        cells[arm, depth].append(r)
    depths = sorted({d for _, d in cells})
    arms = [a for a in ARMS.values() if any((a, d) in cells for d in depths)]
    arms += sorted({a for a, _ in cells} - set(arms))
    head = "| arm | " + " | ".join(f"{d}+{d} layers: test BLEU | test loss" for d in depths) + " |"
    lines = [head, "|---" * (1 + 2 * len(depths)) + "|"]
    for arm in arms:
        row = [arm]
        for d in depths:
            rs = cells.get((arm, d), [])
            ok = [r for r in rs if r["status"] == "completed" and r.get("test_bleu") is not None]
            div = [r for r in rs if r["status"] == "diverged"]
            if rs and len(div) == len(rs):
                steps = ", ".join(str(r.get("diverged_step")) for r in div)
                row += [f"diverged (steps {steps})", "–"]
                continue
            note = f" ({len(div)}/{len(rs)} diverged)" if div else ""
            row += [fmt([r["test_bleu"] for r in ok], 2) + f" (n={len(ok)}){note}",
                    fmt([r["test_loss"] for r in ok], 3)]
        lines.append("| " + " | ".join(row) + " |")
    wall = sum(r.get("wall_s", 0) for rs in cells.values() for r in rs)
    lines.append("")
    lines.append(f"{sum(len(v) for v in cells.values())} runs, {wall / 60:.1f} wall-minutes in total "
                 f"(sum of results.json wall_s).")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
