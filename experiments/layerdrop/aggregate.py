"""Tables (mean ± std over seeds) and the plot of the LayerDrop / DropHead study from the prune
command's outputs: outputs/layerdrop/<arm>-s<seed>/prune/prune.json -> experiments/layerdrop/
results.{md,json} and layerdrop.png.

    .venv/bin/python experiments/layerdrop/aggregate.py [--runs outputs/layerdrop]
    .venv/bin/python experiments/layerdrop/aggregate.py --runs experiments/layerdrop/runs   # the copies kept in git
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
LD_ARMS = {"ld0": "LayerDrop p=0", "ld0.2": "LayerDrop p=0.2", "ld0.5": "LayerDrop p=0.5",
           "ld0.5learned": "LayerDrop p=0.5, learned rates"}
DH_ARMS = {"ld0": "none", "dh_const": "DropHead 0.2 constant", "dh_vshape": "DropHead 0.2 V-shaped"}
STRATEGIES = ("every_other", "search_on_valid", "data_driven")


def load(runs: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for f in sorted(runs.glob("*-s*/prune/prune.json")):
        m = re.fullmatch(r"(.+)-s(\d+)", f.parent.parent.name)
        if m:
            out[m.group(1)][int(m.group(2))] = json.loads(f.read_text())
    return out


def cell(values: list[float | None], digits: int = 2) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}" + ("" if len(values) > 1 else " (1 seed)")


def row_of(data: dict, strategy: str, kept: int) -> dict | None:
    for r in data["rows"]:
        if r["strategy"] == strategy and (strategy == "full" or r["kept"] == kept):
            return r if r.get("test_bleu") is not None else None
    return None


def values(runs: dict[int, dict], strategy: str, kept: int, key: str) -> list:
    return [(row_of(d, strategy, kept) or {}).get(key) for d in runs.values()]


def tables(res: dict, kept: int) -> tuple[str, dict]:
    summary: dict = {"layerdrop": {}, "drophead": {}}
    lines = [f"### LayerDrop: pruned to {kept} of 6 layers per stack (test, first 200 sentences; mean ± std over seeds)",
             "", "| training | seeds | unpruned BLEU | " + " | ".join(f"{s} BLEU" for s in STRATEGIES)
             + " | unpruned NLL | " + " | ".join(f"{s} NLL" for s in STRATEGIES) + " |", "|" + "---|" * 10]
    for arm, label in LD_ARMS.items():
        if arm not in res:
            continue
        runs = res[arm]
        strategies = ("full",) + STRATEGIES
        bleu = [cell(values(runs, s, kept, "test_bleu")) for s in strategies]
        nll = [cell(values(runs, s, kept, "test_nll"), 3) for s in strategies]
        summary["layerdrop"][arm] = {s: {"test_bleu": values(runs, s, kept, "test_bleu"),
                                         "test_nll": values(runs, s, kept, "test_nll"),
                                         "valid_bleu": values(runs, s, kept, "valid_bleu")} for s in strategies}
        lines.append(f"| {label} | {len(runs)} | " + " | ".join(bleu + nll) + " |")
    lines += ["", "### DropHead vs none, same budget (unpruned; test, first 200 sentences)", "",
              "| training | seeds | valid BLEU | test BLEU | valid NLL | test NLL |", "|---|---|---|---|---|---|"]
    for arm, label in DH_ARMS.items():
        if arm not in res:
            continue
        runs = res[arm]
        summary["drophead"][arm] = {k: values(runs, "full", kept, k) for k in ("valid_bleu", "test_bleu", "valid_nll", "test_nll")}
        lines.append(f"| {label} | {len(runs)} | " + " | ".join(
            cell(values(runs, "full", kept, k), 3 if "nll" in k else 2)
            for k in ("valid_bleu", "test_bleu", "valid_nll", "test_nll")) + " |")
    return "\n".join(lines) + "\n", summary


def plot(res: dict, path: Path, seed: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"every_other": "-", "search_on_valid": "--", "data_driven": ":"}
    for color, arm in zip(("C0", "C1", "C2", "C3"), LD_ARMS):
        data = res.get(arm, {}).get(seed)
        if data is None:
            continue
        full = row_of(data, "full", 0)
        for strategy, ls in styles.items():
            pts = sorted((r["kept"], r["test_bleu"], r["test_nll"]) for r in data["rows"]
                         if r["strategy"] == strategy and r.get("test_bleu") is not None)
            if not pts:
                continue
            pts.append((full["kept"], full["test_bleu"], full["test_nll"]))
            x, b, n = zip(*pts)
            label = f"{LD_ARMS[arm]} / {strategy}"
            axes[0].plot(x, b, ls=ls, color=color, marker="o", ms=3, label=label)
            axes[1].plot(x, n, ls=ls, color=color, marker="o", ms=3, label=label)
    axes[0].set_ylabel("test BLEU (sacreBLEU, greedy)")
    axes[1].set_ylabel("test NLL per token (lower is better)")
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("kept layers per stack (of 6)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6, loc="upper right")
    fig.suptitle(f"Pruning LayerDrop-trained models (seed {seed}; 400 steps, d=64, 6+6 layers)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="outputs/layerdrop")
    ap.add_argument("--kept", type=int, default=3)
    args = ap.parse_args()
    res = load(Path(args.runs))
    md, summary = tables(res, args.kept)
    (HERE / "results.md").write_text(md)
    (HERE / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(res, HERE / "layerdrop.png")
    print(md)


if __name__ == "__main__":
    main()
