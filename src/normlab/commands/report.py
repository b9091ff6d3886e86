"""Ablation table from sweep folders: cells = mean ± std over seeds of one metric.

    python -m normlab.commands.report multirun/deep_stack-<id> --rows arm --cols model.encoder_layers
    python -m normlab.commands.report DIR1 DIR2 --rows norm,norm.placement --cols optim.warmup --metric test_bleu_avg
    python -m normlab.commands.report DIR --rows callbacks.drophead_schedule.schedule --cols regularizer.drophead --expect-seeds 3

Every run folder below the given folders is read: results.json (status, metrics), and Hydra's
.hydra/config.yaml, hydra.yaml (choices) and overrides.yaml. A job folder (.hydra/ present) without
results.json counts as failed. --rows / --cols name any Hydra choice (norm, init, arm, regularizer,
...), any config key (model.encoder_layers, regularizer.encoder_layerdrop, optim.warmup) or any
results.json key (seed, status); several keys are joined with commas.

A cell is:
- `27.31 ± 0.12`: mean ± sample std (ddof 1) of the metric over the completed runs (one run: no ±);
- `27.31 ± 0.12 (1/3 diverged, 1/3 failed)`: partial divergence / stall / failure: the mean is over
  the completed runs only, the note says how many of the cell's runs diverged, stalled or failed
  (stalled: trained to the end without learning beyond its input-independent floor,
  normlab/callbacks/stall.py; its scores are in runs.csv, not in the mean);
- `diverged 3/3` / `stalled 2/2` / `failed 1/1` / `diverged 1/2, failed 1/2`: no completed run;
- `running 1/2`: a job folder without results.json written to in the last 10 minutes (older: failed);
- `stopped 1/2` / `preempted 1/2`: stopped by trainer.max_time or a signal; the same command continues it;
- `missing`: an expected cell (observed row values × observed column values) with no run at all;
  with --expect-seeds N, a cell with fewer runs says `(k/N missing)`;
- `n/a`: completed runs without this metric (e.g. test_bleu when eval.test=false).
A results.json that cannot be read (cut off, not a JSON object) is named in one warning line and its
run left out, as missing (report_runs.load_run).
A cell whose runs differ in a resolved config key other than the seed and the table's keys (three
learning rates of post-LN under `--rows norm`) gets one warning line naming the keys. A study's runs
carry their study arm (results.json labels.arm), so `--rows arm` keeps a study's arms apart.

Writes <out>/report.{md,csv,json}, runs.csv and PNG plots (training curves per arm from each run's
csv/metrics.csv, the metric vs a numeric column with error bars, BLEU vs kept depth from the prune
command's prune/prune.json), and prints the table. Default out: <first folder>/report; an existing
out folder is only replaced with --force. --wandb ENTITY/PROJECT reads runs from the W&B API instead
(online only; --wandb-group filters by group = sweep folder name).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from normlab.commands import report_plots
from normlab.identity import NOT_IDENTITY
from normlab.commands.common import CommandError, CommandParser, main_guard
from normlab.outcome import FAILED_TO_TRAIN, UNFINISHED, Status
from normlab.commands.report_runs import (Run, find_runs, fmt_value as _fmt_value, hashable as _hashable, key_of,
                                          label, wandb_runs)

# a cell's notes, in this order (the vocabulary: normlab/outcome.py)
OTHER_STATUSES = (*FAILED_TO_TRAIN, *UNFINISHED, Status.FAILED.value, Status.RUNNING.value)
NOT_SETTINGS = ("seed", "data.seed", "name", "group", "tags", "run_dir", "resume", "project")  # differ by design
PATH_HINTS = ("_src", "_tgt", "dir", "path", "file")


# ---------------------------------------------------------------- the table

def _sort_key(v: Any):
    if v is None:
        return (2, 0, "")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0, str(v))


def _fmt_num(x: float, digits: int | None) -> str:
    d = digits if digits is not None else (0 if abs(x) >= 1000 else 2)
    return f"{x:.{d}f}"


def cell_stats(runs: list[Run], metric: str, expect_seeds: int | None = None, digits: int | None = None) -> dict:
    n = len(runs)
    done = [r for r in runs if r.status == "completed"]
    groups = {s: [r for r in runs if r.status == s] for s in OTHER_STATUSES}
    values = [v for v in (r.metric(metric) for r in done) if v is not None]
    missing = max(0, expect_seeds - n) if expect_seeds else 0
    stats = {"n": n, "completed": len(done), **{s: len(g) for s, g in groups.items()}, "missing": missing,
             "values": values, "seeds": sorted({r.results.get("seed") for r in runs}, key=_sort_key),
             "mean": statistics.fmean(values) if values else None,
             "std": statistics.stdev(values) if len(values) > 1 else None}
    if n == 0:
        stats["text"] = "missing"
        return stats
    if values:
        base = _fmt_num(stats["mean"], digits)
        if stats["std"] is not None:
            base += f" ± {_fmt_num(stats['std'], digits)}"
        notes = [f"{len(group)}/{n} {word}" for word, group in groups.items() if group]
    else:
        base = "n/a" if done else ""
        notes = [f"{word} {len(group)}/{n}" for word, group in groups.items() if group]
    if missing:
        notes.append(f"{missing}/{expect_seeds} missing")
    if base and notes:
        stats["text"] = f"{base} ({', '.join(notes)})"
    else:
        stats["text"] = base or ", ".join(notes)
    return stats


def build_table(runs: list[Run], rows: list[str], cols: list[str], metric: str, expect_seeds: int | None = None,
                digits: int | None = None) -> dict:
    row_vals = sorted({key_of(r, rows) for r in runs}, key=lambda t: [_sort_key(v) for v in t])
    col_vals = sorted({key_of(r, cols) for r in runs}, key=lambda t: [_sort_key(v) for v in t])
    cells = {}
    for rv in row_vals:
        for cv in col_vals:
            members = [r for r in runs if key_of(r, rows) == rv and key_of(r, cols) == cv]
            cells[(rv, cv)] = cell_stats(members, metric, expect_seeds, digits)
            cells[(rv, cv)]["pooled"] = pooled_differences(members, [*rows, *cols])
    return {"rows": rows, "cols": cols, "metric": metric, "row_values": row_vals, "col_values": col_vals,
            "cells": cells}


def markdown_table(table: dict) -> str:
    corner = f"{' / '.join(table['rows'])} \\ {' / '.join(table['cols'])}"
    head = [corner] + [label(c) for c in table["col_values"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rv in table["row_values"]:
        lines.append("| " + " | ".join([label(rv)] + [table["cells"][(rv, cv)]["text"]
                                                      for cv in table["col_values"]]) + " |")
    return "\n".join(lines) + "\n"


def differing_settings(runs: list[Run]) -> dict[str, list]:
    """Config keys and choices whose values differ between runs (seeds, names and paths left out)."""
    keys = sorted({k for r in runs for k in (*r.config, *(f"choice:{c}" for c in r.choices))})
    out = {}
    for k in keys:
        if k in NOT_SETTINGS or k.startswith("hydra") or any(h in k.rsplit(".", 1)[-1] for h in PATH_HINTS):
            continue
        vals = {_hashable(r.choices.get(k[7:]) if k.startswith("choice:") else r.config.get(k)) for r in runs}
        if len(vals) > 1:
            out[k] = sorted(vals, key=_sort_key)
    return out


def pooled_differences(members: list[Run], keys: list[str]) -> dict[str, list]:
    """The resolved config keys whose values differ between the runs pooled into one cell, besides the
    seed, the table's own keys and what does not change what a run learns (identity.NOT_IDENTITY: where
    it ran, how it was logged, its labels): a mean over such runs is not a mean over seeds (three
    learning rates of one scheme under one `arm` row). Choices are file names, not values: left out."""
    def what_ran(key: str) -> bool:
        return not key.startswith(("choice:", "choices.")) and key not in keys \
            and not any(key == k or key.startswith(k + ".") for k in NOT_IDENTITY)
    return {k: v for k, v in differing_settings(members).items() if what_ran(k)} if len(members) > 1 else {}


def pooling_warning(table: dict) -> str | None:
    """One line naming the keys that differ inside cells (pooled_differences), or None."""
    pooled = [(cell, c["pooled"]) for cell, c in table["cells"].items() if c.get("pooled")]
    if not pooled:
        return None
    keys = sorted({k for _, diff in pooled for k in diff})
    (rv, cv), diff = pooled[0]
    example = "; ".join(f"{k}: {', '.join(_fmt_value(v) for v in vals)}" for k, vals in diff.items())
    return (f"warning: {len(pooled)} of {len(table['cells'])} cells pool runs whose configs differ in {', '.join(keys)} "
            f"(cell {label(rv)} × {label(cv)}: {example}): add the keys to --rows or --cols to separate them")


def signatures(runs: list[Run], prune: dict[Path, dict]) -> list[str]:
    sigs = {r.results.get("bleu_signature") for r in runs} | {p.get("bleu_signature") for p in prune.values()}
    return sorted(s for s in sigs if s)


def load_prune(runs: list[Run]) -> dict[Path, dict]:
    """The prune command's output (normlab.commands.prune: {..., "rows": [{strategy, kept, test_bleu}]})."""
    out = {}
    for r in runs:
        for p in sorted(r.path.rglob("prune.json")) if r.path.is_dir() else []:
            try:
                data = json.loads(p.read_text())
            except ValueError:
                continue
            if isinstance(data.get("rows"), list):
                out[r.path] = data
                break
    return out


def prune_table(runs: list[Run], rows: list[str], prune: dict[Path, dict], digits: int | None) -> list[dict]:
    """Per row value × strategy × kept depth: mean ± std of test BLEU (valid BLEU if no test) over runs."""
    acc: dict[tuple, list[float]] = {}
    for r in runs:
        for pr in prune.get(r.path, {}).get("rows", []):
            v = pr.get("test_bleu") if pr.get("test_bleu") is not None else pr.get("valid_bleu")
            if v is not None:
                acc.setdefault((key_of(r, rows), pr["strategy"], pr["kept"]), []).append(float(v))
    out = []
    for (rv, strategy, kept), vals in sorted(acc.items(), key=lambda kv: ([_sort_key(v) for v in kv[0][0]],
                                                                          kv[0][1], kv[0][2])):
        mean = statistics.fmean(vals)
        std = statistics.stdev(vals) if len(vals) > 1 else None
        text = _fmt_num(mean, digits) + (f" ± {_fmt_num(std, digits)}" if std is not None else "")
        out.append({"row": list(rv), "strategy": strategy, "kept": kept, "n": len(vals), "mean": mean, "std": std,
                    "text": text})
    return out


def prune_markdown(ptable: list[dict], rows: list[str]) -> str:
    depths = sorted({p["kept"] for p in ptable})
    groups = sorted({(tuple(p["row"]), p["strategy"]) for p in ptable},
                    key=lambda g: ([_sort_key(v) for v in g[0]], g[1] != "full", g[1]))
    head = [" / ".join(rows), "strategy"] + [f"kept {d}" for d in depths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rv, strategy in groups:
        by = {p["kept"]: p["text"] for p in ptable if tuple(p["row"]) == rv and p["strategy"] == strategy}
        lines.append("| " + " | ".join([label(rv), strategy] + [by.get(d, "") for d in depths]) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- output

def _shown(path: Path, sources: list[str]) -> str:
    for s in sources:
        try:
            return str(Path(s) / path.relative_to(s))
        except ValueError:
            continue
    return str(path)


def render_markdown(table: dict, runs: list[Run], sources: list[str], prune: dict, ptable: list[dict],
                    plots: list[str]) -> str:
    n = {s: sum(r.status == s for r in runs) for s in ("completed", *OTHER_STATUSES)}
    missing = sum(c["n"] == 0 for c in table["cells"].values())
    out = [f"# Ablation: {table['metric']} by {', '.join(table['rows'])} × {', '.join(table['cols'])}", "",
           f"{len(runs)} runs from {', '.join(sources)}: " + ", ".join(f"{k} {s}" for s, k in n.items())
           + f"; {missing} of {len(table['cells'])} cells missing. Cells: mean ± std over seeds "
           "of the completed runs; notes count the cell's diverged / stalled / failed runs.", "",
           markdown_table(table)]
    warning = pooling_warning(table)
    if warning:
        out += [f"**{warning}**", ""]
    sigs = signatures(runs, prune)
    out += ["sacreBLEU: " + ("; ".join(f"`{s}`" for s in sigs) if sigs else "(no signature in the results)"), ""]
    diff = differing_settings(runs)
    if diff:
        out += ["## Settings that differ between runs", "", "| key | values |", "|---|---|"]
        out += [f"| {k} | {', '.join(_fmt_value(v) for v in vals)} |" for k, vals in diff.items()] + [""]
    if ptable:
        out += ["## BLEU after pruning (prune command)", "", prune_markdown(ptable, table["rows"])]
    bad = [r for r in runs if r.status != "completed"]
    if bad:
        out += ["## Runs that did not complete (diverged, stalled, stopped, preempted, failed, running)", "",
                "| run | status | detail |", "|---|---|---|"]
        for r in bad:
            detail = (f"step {r.results.get('diverged_step')}: {r.results.get('divergence_reason', '')}"
                      if r.status == "diverged" else r.results.get("stall_reason", "") if r.status == "stalled"
                      else (r.error or "").splitlines()[0][:200])
            out.append(f"| {_shown(r.path, sources)} | {r.status} | {detail.replace('|', '/')} |")
        out.append("")
    out += [f"![{p}]({p})" for p in plots]
    return "\n".join(out) + "\n"


def cells_csv(table: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*table["rows"], *table["cols"], "metric", "n", "completed", *OTHER_STATUSES, "missing",
                "mean", "std", "seeds", "cell"])
    for (rv, cv), c in table["cells"].items():
        w.writerow([*map(_fmt_value, rv), *map(_fmt_value, cv), table["metric"], c["n"], c["completed"],
                    *(c[s] for s in OTHER_STATUSES), c["missing"], "" if c["mean"] is None else c["mean"],
                    "" if c["std"] is None else c["std"], " ".join(map(str, c["seeds"])), c["text"]])
    return buf.getvalue()


def runs_csv(runs: list[Run], table: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    keys = [*table["rows"], *table["cols"]]
    w.writerow([*keys, "seed", "status", table["metric"], "error", "path"])
    for r in runs:
        w.writerow([*(_fmt_value(r.get(k)) for k in keys), r.results.get("seed"), r.status,
                    r.results.get(table["metric"]), (r.error or "").splitlines()[0] if r.error else "", r.path])
    return buf.getvalue()


def to_json(table: dict, runs: list[Run], prune: dict, ptable: list[dict]) -> dict:
    return {"metric": table["metric"], "rows": table["rows"], "cols": table["cols"],
            "cells": [{"row": list(rv), "col": list(cv), **{k: v for k, v in c.items()}}
                      for (rv, cv), c in table["cells"].items()],
            "signatures": signatures(runs, prune), "differing_settings": differing_settings(runs),
            "prune": ptable,
            "runs": [{"path": str(r.path), "status": r.status, "error": r.error, "seed": r.results.get("seed"),
                      "row": [r.get(k) for k in table["rows"]], "col": [r.get(k) for k in table["cols"]],
                      table["metric"]: r.results.get(table["metric"])} for r in runs]}


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(prog="python -m normlab.commands.report", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("folders", nargs="*", help="multirun (or run) folders; every run below them is read")
    ap.add_argument("--rows", required=True, help="comma-separated keys for the rows (e.g. norm,init or arm)")
    ap.add_argument("--cols", required=True, help="comma-separated keys for the columns (e.g. model.encoder_layers)")
    ap.add_argument("--metric", default="test_bleu",
                    help="a results.json key: test_bleu (default), test_bleu_avg, valid_bleu, valid_loss, "
                         "train_tokens_per_s, ...")
    ap.add_argument("--expect-seeds", type=int, default=None, help="runs each cell should have; fewer -> 'k/N missing'")
    ap.add_argument("--digits", type=int, default=None, help="decimals (default: 2, or 0 for values >= 1000)")
    ap.add_argument("--out", help="output folder (default: <first folder>/report)")
    ap.add_argument("--force", action="store_true", help="replace an existing output folder")
    ap.add_argument("--no-plots", action="store_true", help="tables only")
    ap.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read the runs from the W&B API (online) instead")
    ap.add_argument("--wandb-group", help="with --wandb: only this group (a sweep folder's name)")
    args = ap.parse_args(argv)
    rows = [k.strip() for k in args.rows.split(",") if k.strip()]
    cols = [k.strip() for k in args.cols.split(",") if k.strip()]
    if not args.folders and not args.wandb:
        raise CommandError("give at least one folder (or --wandb ENTITY/PROJECT)")
    if args.expect_seeds is not None and args.expect_seeds < 1:
        raise CommandError(f"--expect-seeds={args.expect_seeds} must be >= 1")
    out = Path(args.out) if args.out else (Path(args.folders[0]) / "report" if args.folders else Path("report"))
    if out.exists() and not args.force:
        raise CommandError(f"{out} exists; pass --force to replace it (or --out another folder)")
    runs = wandb_runs(args.wandb, args.wandb_group) if args.wandb else find_runs(args.folders)
    runs = [r for r in runs if out.resolve() not in r.path.resolve().parents]
    if not runs:
        raise CommandError(f"no runs (results.json or .hydra/config.yaml) below {', '.join(args.folders)}")
    table = build_table(runs, rows, cols, args.metric, args.expect_seeds, args.digits)
    prune = load_prune(runs)
    ptable = prune_table(runs, rows, prune, args.digits)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    plots = [] if args.no_plots else _plots(out, table, runs, prune)
    sources = args.folders or [f"wandb:{args.wandb}"]
    (out / "report.md").write_text(render_markdown(table, runs, sources, prune, ptable, plots), encoding="utf-8")
    (out / "report.csv").write_text(cells_csv(table), encoding="utf-8")
    (out / "runs.csv").write_text(runs_csv(runs, table), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(to_json(table, runs, prune, ptable), indent=2, default=str),
                                     encoding="utf-8")
    print(markdown_table(table))
    for s in signatures(runs, prune):
        print(f"sacreBLEU: {s}")
    pooled = pooling_warning(table)
    if pooled:
        print(pooled, file=sys.stderr)
    print(f"-> {out}/report.{{md,csv,json}}, runs.csv" + (f", {', '.join(plots)}" if plots else ""), file=sys.stderr)
    return 0


def _plots(out: Path, table: dict, runs: list[Run], prune: dict) -> list[str]:
    return report_plots.all_plots(out, table, runs, prune)


if __name__ == "__main__":
    raise SystemExit(main_guard(main))
