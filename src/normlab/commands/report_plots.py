"""The report command's PNG plots (matplotlib, Agg): training curves per arm, the metric vs a numeric
column with error bars, and BLEU vs kept depth after pruning. Each is skipped when its data is absent."""
from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path

from normlab.commands.report_runs import Run, key_of, label


LINES = {"diverged": "--", "stalled": ":"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_curve(run: Run, column: str = "train/loss") -> tuple[list[int], list[float]]:
    path = run.path / "csv" / "metrics.csv"  # Lightning's CSVLogger (logger=csv) in the run folder
    if not path.is_file():
        return [], []
    steps, values = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            v = row.get(column)
            if v not in (None, "") and row.get("step") not in (None, ""):
                x = float(v)
                if math.isfinite(x):
                    steps.append(int(float(row["step"])))
                    values.append(x)
    return steps, values


def curves(path: Path, table: dict, runs: list[Run]) -> bool:
    """One panel per row value, one colour per column value, one line per seed (dashed: diverged,
    dotted: stalled)."""
    data = [(r, *read_curve(r)) for r in runs]
    data = [d for d in data if d[1]]
    if not data:
        return False
    plt = _plt()
    row_vals = [rv for rv in table["row_values"] if any(key_of(r, table["rows"]) == rv for r, *_ in data)]
    ncols = min(3, len(row_vals))
    nrows = math.ceil(len(row_vals) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), sharey=True, squeeze=False)
    colours = {cv: plt.cm.viridis(i / max(1, len(table["col_values"]) - 1)) for i, cv in enumerate(table["col_values"])}
    for ax, rv in zip(axes.flat, row_vals):
        seen = set()
        for r, steps, values in data:
            if key_of(r, table["rows"]) != rv:
                continue
            cv = key_of(r, table["cols"])
            lab = f"{', '.join(table['cols'])}={label(cv)}" if cv not in seen else None
            seen.add(cv)
            ax.plot(steps, values, color=colours[cv], lw=1, ls=LINES.get(r.status, "-"), label=lab)
        ax.set_title(f"{', '.join(table['rows'])}={label(rv)}", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(row_vals):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("train loss")
    fig.suptitle("training loss per arm (one line per seed; dashed: diverged, dotted: stalled)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _numeric(values: list[tuple]) -> bool:
    return all(len(v) == 1 and isinstance(v[0], (int, float)) and not isinstance(v[0], bool) for v in values)


def metric_vs_column(path: Path, table: dict) -> bool:
    """The metric against a single numeric column key (e.g. depth), one line per row, ± std bars;
    none for a single column value (one point per row says nothing the table does not)."""
    if len(table["cols"]) != 1 or table["cols"][0] == "seed" or not _numeric(table["col_values"]):
        return False
    if len(table["col_values"]) < 2:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    marked = False
    for rv in table["row_values"]:
        pts = [(cv[0], table["cells"][(rv, cv)]) for cv in table["col_values"]]
        ok = [(x, c["mean"], c["std"] or 0.0) for x, c in pts if c["mean"] is not None]
        if ok:
            xs, ys, es = zip(*ok)
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label(rv))
        bad = [x for x, c in pts if c["mean"] is None and (c["diverged"] or c["stalled"])]
        if bad:
            ax.scatter(bad, [0.0] * len(bad), marker="x", color="red", zorder=3,
                       label=None if marked else "diverged / stalled (no value)")
            marked = True
    ax.set_xlabel(table["cols"][0])
    ax.set_ylabel(table["metric"])
    ax.set_xticks(sorted({cv[0] for cv in table["col_values"]}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title=", ".join(table["rows"]), title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def prune_depth(path: Path, table: dict, runs: list[Run], prune: dict) -> bool:
    """Test BLEU (valid if no test) vs kept layers: one panel per pruning strategy, one line per row value."""
    by_path = {r.path: r for r in runs}
    series: dict[tuple, dict[int, list[float]]] = {}  # (strategy, row value) -> kept -> values
    full: dict[tuple, dict[int, list[float]]] = {}
    for p, data in prune.items():
        rv = key_of(by_path[p], table["rows"])
        for row in data["rows"]:
            v = row.get("test_bleu") if row.get("test_bleu") is not None else row.get("valid_bleu")
            if v is None:
                continue
            target = full if row["strategy"] == "full" else series
            target.setdefault((row["strategy"], rv), {}).setdefault(int(row["kept"]), []).append(float(v))
    if not series:
        return False
    plt = _plt()
    strategies = sorted({s for s, _ in series})
    fig, axes = plt.subplots(1, len(strategies), figsize=(4.2 * len(strategies), 3.4), sharey=True, squeeze=False)
    for ax, strategy in zip(axes[0], strategies):
        for (s, rv), pts in sorted(series.items(), key=lambda kv: str(kv[0][1])):
            if s != strategy:
                continue
            pts = {**pts, **full.get(("full", rv), {})}  # the unpruned model closes the curve
            xs = sorted(pts)
            ys = [statistics.fmean(pts[x]) for x in xs]
            es = [statistics.stdev(pts[x]) if len(pts[x]) > 1 else 0.0 for x in xs]
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label(rv))
        ax.set_title(strategy, fontsize=9)
        ax.set_xlabel("kept layers per stack")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("BLEU after pruning")
    axes[0][0].legend(fontsize=8, title=", ".join(table["rows"]), title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def all_plots(out: Path, table: dict, runs: list[Run], prune: dict) -> list[str]:
    made = []
    if curves(out / "curves.png", table, runs):
        made.append("curves.png")
    elif runs:  # say why, instead of a report that silently has no curves
        print("note: no training curves: no run has csv/metrics.csv (the CSV logger is in the default "
              "logger=[wandb,csv]; keep csv when choosing loggers)", file=sys.stderr)
    name = f"{table['metric']}_vs_{table['cols'][0].replace('.', '_')}.png"
    if metric_vs_column(out / name, table):
        made.append(name)
    if prune and prune_depth(out / "prune_depth.png", table, runs, prune):
        made.append("prune_depth.png")
    return made
