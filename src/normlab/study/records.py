"""A study's records: one folder per (arm, seed) under <out>/runs/, written by the runner, read by
the claims and the report (results.json, test.hyp.gz, metrics.csv, prune.json)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from normlab.study.damaged import json_object, read_metrics, read_results, read_text, warn


@dataclass
class Record:
    path: Path
    arm: str
    seed: int
    results: dict

    @property
    def status(self) -> str:
        return str(self.results.get("status") or "failed")

    def metric(self, name: str) -> float | None:
        """A results.json score, a pruned model's (prune.<strategy>.r<kept>.<column>), a logged series'
        value at the end of training (end.<series>, e.g. end.train_nll), the observatory's mean of a
        statistic over a stack's blocks (obs.<stack>[.<sub-layer>].<statistic>), or a number inside results.json
        at a dotted path (observatory.step)."""
        if name.startswith("prune."):
            return self.prune_metric(name)
        if name.startswith("end."):
            return self.end_value(name[4:])
        if name.startswith("obs."):
            return observatory_mean(self.results.get("observatory"), name)
        return _number(self.results[name] if name in self.results else dotted(self.results, name))

    def prune_metric(self, name: str) -> float | None:
        _, strategy, kept, column = name.split(".", 3)
        path = self.path / "prune.json"
        data, problem = json_object(path)
        rows = (data or {}).get("rows") or []
        if problem or not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            if problem or data is not None:
                warn(path, problem or "rows is not a list of objects", "its pruned models' scores are left out")
            return None
        for row in rows:
            if row.get("strategy") == strategy and f"r{row.get('kept')}" == kept:
                v = row.get(column)
                return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
        return None

    def end_value(self, series: str) -> float | None:
        """The mean of a logged series over the run's last tenth of steps: the training loss where
        training ended, smoothed over the noise of single batches."""
        points = self.curve(series)
        if not points:
            return None
        last = max(s for s, _ in points)
        tail = [v for s, v in points if s >= 0.9 * last]
        return sum(tail) / len(tail)

    def hypotheses(self, metric: str = "test_bleu") -> list[str] | None:
        """The test translations a BLEU metric was computed from: test.hyp.gz for test_bleu,
        prune.<strategy>.r<kept>.test.hyp.gz for prune.<strategy>.r<kept>.test_bleu."""
        if not is_test_bleu(metric):
            return None
        text = read_text(self.path / f"{metric[:-len('_bleu')]}.hyp.gz",
                         "its translations are left out (no test-set check over sentences with it)")
        return None if text is None else text.split("\n")[:-1]

    def plateau(self, window: int, min_delta: float, cap: int) -> dict | None:
        """Where the run stopped learning: {"step": the validation step of its plateau, or None if it
        never reached one; "steps": the steps it trained; "cap"; "from": where this was read}.
        results.json's `plateau` when the run wrote one (callbacks/plateau.py), else normlab.plateau's
        rule on metrics.csv's valid/loss with the study's window and min_delta (every record trained
        before runs stopped at a plateau); None when neither is there."""
        own = self.results.get("plateau")
        steps = self.results.get("steps")
        if isinstance(own, dict) and "step" in own:
            return {"step": own["step"], "steps": steps, "cap": own.get("cap", cap), "from": "results.json"}
        points = self.curve("valid_loss")
        if not points:
            return None
        from normlab.plateau import plateau_step

        step = plateau_step([s for s, _ in points], [v for _, v in points], window, min_delta)
        return {"step": step, "steps": steps if steps is not None else points[-1][0] + 1, "cap": cap,
                "from": "metrics.csv"}

    def still_improving(self, window: int, min_delta: float, cap: int) -> bool | None:
        """A completed run that never reached a plateau: a run stops at its plateau or at the end of
        its steps (the cap), so it ended while still learning. Not completed: False (diverged or
        stalled runs are judged as such); None: not known (no plateau recorded, no valid/loss curve)."""
        if self.status != "completed":
            return False
        p = self.plateau(window, min_delta, cap)
        return None if p is None else p["step"] is None

    def curve(self, column: str) -> list[tuple[int, float]]:
        """(step, value) of a logged series (metrics.csv: valid/loss for valid_loss)."""
        key = column.replace("_", "/", 1)
        rows = read_metrics(self.path / "metrics.csv") or []
        return [(row["step"], row[key]) for row in rows if key in row and "step" in row]


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def dotted(node, path: str):
    """The value at a dotted path in nested mappings, a key that itself holds dots (a block's name,
    `dec.0.self_attn`) matched whole: the longest key that prefixes the rest first; None if none."""
    if not path:
        return node
    if not isinstance(node, dict):
        return None
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in node:
            found = dotted(node[key], ".".join(parts[i:]))
            if found is not None:
                return found
    return None


# obs.<stack>[.<sub-layer>].<statistic>: results.json `observatory` ({"step": N, "layers": {block:
# {statistic: v}}}, callbacks/observatory.py) as one number per run: the mean over the stack's blocks (enc,
# dec, or all), of one kind of sub-layer if named (self_attn, cross_attn, ffn), that measured the statistic;
# a per-head statistic (sink_h0, sink_h1, ...: `sink`) is first averaged over the heads. E.g.
# obs.dec.self_attn.sink (the decoder's self-attention sink rate: in cross-attention key 0 is the first
# source token, not the sink Qiu et al. 2025 measure), obs.all.kurtosis (excess kurtosis of the stream).
STACKS = ("enc", "dec", "all")
SUBLAYERS = ("self_attn", "cross_attn", "ffn")
# what callbacks/observatory.py measures per block (a per-head one by its name without _h<i>);
# tests/test_observatory.py checks this against the callback's output
STATISTICS = ("rms", "max_abs", "kurtosis", "out_rms", "out_max_abs", "entropy", "sink", "max_logit",
              "grad_norm", "grad_spike")
PER_HEAD = ("entropy", "sink")  # also read one head at a time: sink_h0, entropy_h3


def observatory_name_problem(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(what is wrong, the allowed values) of an obs.<stack>[.<sub-layer>].<statistic> name, None if it is
    one: a study refuses a claim on a mistyped one when it is loaded, not at judging as "no score"."""
    parts = name.split(".")[1:]
    grammar = f"{name!r}: not obs.<{'|'.join(STACKS)}>[.<{'|'.join(SUBLAYERS)}>].<statistic>"
    if len(parts) not in (2, 3):
        return grammar, STATISTICS
    if parts[0] not in STACKS:
        return f"{name!r}: {parts[0]!r} is not a stack of the observatory", STACKS
    if len(parts) == 3 and parts[1] not in SUBLAYERS:
        return f"{name!r}: {parts[1]!r} is not a kind of sub-layer of the observatory", SUBLAYERS
    stat, _, head = parts[-1].partition("_h")
    per_head = stat in PER_HEAD and head.isdigit()  # one head's value, as the observatory names it
    if parts[-1] not in STATISTICS and not per_head:
        return (f"{name!r}: {parts[-1]!r} is not a statistic of the observatory",
                (*STATISTICS, *(f"{s}_h<i>" for s in PER_HEAD)))
    return None


def observatory_mean(obs, name: str) -> float | None:
    parts = name.split(".")[1:]
    if len(parts) == 2:
        (stack, stat), sub = parts, None
    elif len(parts) == 3 and parts[1] in SUBLAYERS:
        stack, sub, stat = parts
    else:
        return None
    layers = obs.get("layers") if isinstance(obs, dict) else None
    if stack not in STACKS or not stat or not isinstance(layers, dict):
        return None
    per_block = []
    for block, stats in layers.items():
        if stack != "all" and not str(block).startswith(stack + ".") or not isinstance(stats, dict):
            continue
        if sub is not None and not str(block).endswith("." + sub):
            continue
        values = [_number(v) for k, v in stats.items() if k == stat or (k.startswith(stat + "_h") and k[len(stat) + 2:].isdigit())]
        values = [v for v in values if v is not None]
        if values:
            per_block.append(sum(values) / len(values))
    return sum(per_block) / len(per_block) if per_block else None


def is_test_bleu(metric: str) -> bool:
    """A test BLEU whose translations a record keeps: the run's, or one of its pruned models'."""
    return metric == "test_bleu" or (metric.startswith("prune.") and metric.endswith(".test_bleu"))


def holding_study(record: Path, results: dict) -> str | None:
    """The study that holds a record: the folder it is in (<study>/runs/<arm>-s<seed>/, as the runner
    writes it), which is the study's current name; results.json's `study.name` is the name the study
    had when it wrote the record (twt_lowres for twt_lowres_2k's, a name another study has now), read
    for a record elsewhere. None: not a study's record."""
    held = results.get("study")
    if not isinstance(held, dict):
        return None
    record = record.resolve()  # `normlab-runs .` inside a record: its folder's own name
    in_place = record.parent.name == "runs" and record.name == f"{held.get('arm')}-s{held.get('seed')}"
    return record.parent.parent.name if in_place else held.get("name")


def _left_old(folder: Path) -> bool:
    """A record's `.old` folder that a write left alone (stopped between its renames): the record."""
    name = folder.name
    return name.endswith(".old") and not folder.with_name(name[1:-len(".old")]).exists()


def load_records(out: Path) -> dict[str, list[Record]]:
    """{arm: [records sorted by seed]}; a damaged record is named and left out (study/damaged.py)."""
    by_arm: dict[str, list[Record]] = {}
    for res_path in sorted((out / "runs").glob("*/results.json")):
        if res_path.parent.name.startswith(".") and not _left_old(res_path.parent):
            continue  # a record being written (record_swap's temp folder), or the one it replaces
        res = read_results(res_path, record=True)
        if res is None:
            continue
        info = res.get("study") or {}
        rec = Record(res_path.parent, str(info.get("arm")), info.get("seed", res.get("seed")), res)
        by_arm.setdefault(rec.arm, []).append(rec)
    for recs in by_arm.values():
        recs.sort(key=lambda r: r.seed)
    _name_stray_files(out / "runs")
    return by_arm


def _name_stray_files(runs: Path) -> None:
    """A file where a record's folder should be (runs/<arm>-s<seed>) holds no record: named once (the
    glob above does not see it), left as it is. Other files (notes, a README) are not records."""
    for entry in sorted(runs.iterdir()) if runs.is_dir() else []:
        if not entry.name.startswith(".") and re.search(r"-s\d+$", entry.name) and not entry.is_dir():
            read_results(entry / "results.json", record=True)  # named as --status names it: unreadable (Not a directory)
