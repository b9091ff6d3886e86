"""Each arm at its own regime, chosen on validation: a per-arm screen by successive halving (issue 35
item 1, issue 36 item 1; Jamieson & Talwalkar 2016, Li et al. 2018 "Hyperband").

A study file's `screen:` names a grid of settings (e.g. learning rate x warmup), the rungs (steps at
which the settings are ranked) and the share kept at each rung:

    screen:
      grid: {optim.lr: [5e-4, 1e-3, 2e-3, 3e-3], optim.warmup: [150, 1000]}
      rungs: [250, 1000]      # multiples of trainer.val_check_interval: a validation ranks them
      keep: 0.25              # the best quarter (at least 1) goes on after each rung but the last
      seed: 1                 # the screen's seed: one of the study's
      by: valid_loss          # what ranks them (a validation metric: test scores never choose)

Every setting of an arm trains to the first rung (`callbacks.preemption.stop_at_step`: a full
checkpoint, the run paused); the best `keep` of those that neither diverged nor stalled continue
from their checkpoints to the next rung, and so on; after the last rung the single best is the arm's
setting. Continuing is exact (tests/test_runs_survive.py: rungs against a straight run) and the pause
is not part of a run's identity, so the chosen setting's screen run, continued to the full budget, is
the arm's run on the screen's seed: the screen costs only the steps of the settings it dropped.
With 8 settings, rungs [250, 1000] and keep 0.25 on a 2,000-step budget: 8 x 250 + 2 x 750 + the
winner's last 1,000 = 4,500 steps, 2.25 runs for the arm's first seed and its screen together.

An arm with `screen: false` runs at the study's common settings (a reference shared with another
study). The choice is written to <out>/screen/<arm>.json with every setting's rung values and where
it was dropped, which the README shows as a table and a plot.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from normlab.errors import UserError
from normlab.json_file import json_object
from normlab.study.damaged import read_metrics, warn
from normlab.study.record_swap import live


@dataclass(frozen=True)
class Screen:
    grid: tuple[tuple[str, tuple], ...]   # (override key, values), in the file's order
    rungs: tuple[int, ...]
    keep: float = 0.25
    seed: int = 1
    by: str = "valid_loss"

    def settings(self) -> list[dict]:
        """Every combination of the grid, the first key varying slowest: [{key: value}]."""
        keys = [k for k, _ in self.grid]
        return [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in self.grid))]

    def kept(self, n: int, rung_index: int) -> int:
        """How many of n settings go on after rung `rung_index`: the best `keep` (at least 1); after the
        last rung, one."""
        return 1 if rung_index == len(self.rungs) - 1 else max(1, math.ceil(n * self.keep))


def setting_overrides(setting: dict) -> list[str]:
    return [f"{k}={_value(v)}" for k, v in setting.items()]


def setting_name(setting: dict) -> str:
    """A folder-safe name: {optim.lr: 0.001, optim.warmup: 150} -> "lr0.001-warmup150"."""
    return "-".join(f"{k.rsplit('.', 1)[-1]}{_value(v)}" for k, v in setting.items())


def _value(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def load_screen(raw: dict | None, where: str, seeds: list[int]) -> Screen | None:
    """The study file's `screen:` node, checked (one line naming the key), or None."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise UserError(f"{where}: screen", "must be a mapping (grid, rungs, keep, seed, by)")
    unknown = sorted(set(raw) - {"grid", "rungs", "keep", "seed", "by"})
    if unknown:
        raise UserError(f"{where}: screen.{unknown[0]}", "not a screen key", ["grid", "rungs", "keep", "seed", "by"])
    grid = raw.get("grid")
    if not isinstance(grid, dict) or not grid or not all(isinstance(v, list) and v for v in grid.values()):
        raise UserError(f"{where}: screen.grid", "must map train.py keys to non-empty lists of values")
    rungs = raw.get("rungs")
    if (not isinstance(rungs, list) or not rungs or not all(isinstance(r, int) and not isinstance(r, bool) and r > 0
                                                            for r in rungs) or rungs != sorted(set(rungs))):
        raise UserError(f"{where}: screen.rungs", f"{rungs!r}: must be increasing positive step counts")
    keep = raw.get("keep", 0.25)
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
        raise UserError(f"{where}: screen.keep", f"{keep!r}: must be a share in (0, 1]")
    seed = raw.get("seed", seeds[0])
    if seed not in seeds:
        raise UserError(f"{where}: screen.seed", f"{seed!r} is not one of the study's seeds", [str(s) for s in seeds])
    by = str(raw.get("by", "valid_loss"))
    if not by.startswith("valid_"):
        raise UserError(f"{where}: screen.by", f"{by!r}: a screen ranks by a validation metric (test scores never "
                        "choose a setting)", ["valid_loss", "valid_nll", "valid_bleu"])
    return Screen(tuple((str(k), tuple(v)) for k, v in grid.items()), tuple(rungs), float(keep), int(seed), by)


def check_rungs(screen: Screen, max_steps: int, val_interval) -> None:
    """Every rung is a validation step before the budget's end (else nothing ranks the settings)."""
    if not isinstance(val_interval, int) or isinstance(val_interval, bool):
        raise UserError("screen.rungs", "need trainer.val_check_interval in optimizer steps (an integer)")
    for r in screen.rungs:
        if r % val_interval or r >= max_steps:
            raise UserError("screen.rungs", f"{r} must be a multiple of trainer.val_check_interval={val_interval} "
                            f"below trainer.max_steps={max_steps}")


def metrics_csv(path: Path) -> Path:
    """A run's metrics.csv: `path` itself, or in a folder: a run folder's csv/metrics.csv, else a
    record's metrics.csv (a screen's rung record, runner.write_record; its `.old` folder where its
    write stopped between its renames: record_swap)."""
    path = live(Path(path))
    if not path.is_dir():
        return path
    return path / "csv" / "metrics.csv" if (path / "csv").is_dir() else path / "metrics.csv"


def rung_value(metrics: Path, step: int, by: str) -> float | None:
    """The validation metric `by` (valid_loss -> valid/loss) the run logged at optimizer step `step`
    (Lightning's 0-based step `step - 1` in metrics.csv), None if it has none (diverged, stalled).
    `metrics`: its metrics.csv, or the folder that holds it (metrics_csv)."""
    column = "valid/" + by[len("valid_"):]
    for row in read_metrics(metrics_csv(metrics)) or []:  # damaged: named once, no value
        if row.get("step") == step - 1 and column in row:
            return row[column] if math.isfinite(row[column]) else None
    return None


def ranked_value(metrics: Path, step: int, by: str, status: str | None) -> float | None:
    """What a setting is ranked by at the rung at `step`: its validation there (rung_value). A run that
    completed before the rung stopped at its plateau (callbacks.plateau: its loss gained less than the
    study's min_delta over the window), so its last validation stands for it; it had no value at the rung
    and was ranked as a diverged one."""
    value = rung_value(metrics, step, by)
    if value is not None or status != "completed":
        return value
    column = "valid/" + by[len("valid_"):]
    before = [row for row in read_metrics(metrics_csv(metrics)) or []
              if row.get("step", step) < step and column in row]
    last = max(before, key=lambda row: row["step"], default=None)
    return last[column] if last is not None and math.isfinite(last[column]) else None


def validated(metrics: Path, rung: int, status: str | None) -> bool:
    """Whether a record's metrics.csv holds the validation it is ranked by at `rung` (ranked_value):
    the rung's own (a run paused at or past the rung), or a last one before it (a run completed at its
    plateau). A file cut off or emptied holds neither: its record is not read (screen_run.ranks)."""
    rows = read_metrics(metrics_csv(metrics)) or []  # damaged: named once, no rows
    logged = [row for row in rows if any(k.startswith("valid/") for k in row)]  # nan too: logged, ranked as none
    if any(row.get("step") == rung - 1 for row in logged):
        return True
    return status == "completed" and any(row.get("step", rung) < rung for row in logged)


def lower_better(by: str) -> bool:
    return bool(re.search(r"(loss|nll|ppl)$", by))


def rank(values: dict[str, float | None], by: str) -> list[str]:
    """The settings with a value, best first (ties: the grid's order, which `values` keeps)."""
    order = list(values)
    scored = [k for k in order if values[k] is not None]
    sign = 1.0 if lower_better(by) else -1.0
    return sorted(scored, key=lambda k: (sign * float(values[k]), order.index(k)))


def survivors(screen: Screen, rung_index: int, values: dict[str, float | None]) -> list[str]:
    """The settings that go on after rung `rung_index` (after the last: the one chosen), best first:
    the best `keep` of those with a value at the rung (screen.kept of all that reached it)."""
    return rank(values, screen.by)[:screen.kept(len(values), rung_index)]


def write_choice(path: Path, arm: str, screen: Screen, rows: list[dict], chosen: str | None) -> None:
    """<out>/screen/<arm>.json: every setting's rung values and where it was dropped, and the choice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"arm": arm, "by": screen.by, "rungs": list(screen.rungs), "keep": screen.keep,
                               "seed": screen.seed, "settings": rows, "chosen": chosen}, indent=2) + "\n")
    tmp.replace(path)


NOT_DECIDED = "treated as not decided and left as it is (move it away: the screen is ranked again from its rung records)"


def choice_problem(path: Path) -> str | None:
    """What keeps <out>/screen/<arm>.json from being read as a screen's record (write_choice's keys and
    types, which the status, the outcome claims and the README compute with); None when it is absent
    or fine."""
    return _checked_choice(path)[1]


def _checked_choice(path: Path) -> tuple[dict | None, str | None]:
    """(the screen's record, None), (None, what is wrong with it), or (None, None) when it is absent."""
    data, problem = json_object(path)  # the words results.json's damage is named in (empty, not UTF-8, ...)
    if data is None:
        return None, problem
    rows = data.get("settings")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in rows):
        return None, "settings is not a list of named settings"
    for r in rows:
        problem = _row_problem(r)
        if problem:
            return None, f"setting {r['name']}: {problem}"
    chosen = data.get("chosen")
    if chosen is not None and chosen not in [r["name"] for r in rows]:
        return None, f"chosen {chosen!r} is none of its settings"
    if not isinstance(data.get("rungs"), list) or not all(_count(v) for v in data["rungs"]) or not data["rungs"]:
        return None, "rungs is not a list of steps"
    return data, None


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _row_problem(r: dict) -> str | None:
    missing = [k for k in ("overrides", "values", "status", "dropped_at") if k not in r]
    if missing:
        return f"no {', '.join(missing)}"
    ov = r.get("overrides")
    if not isinstance(ov, list) or not all(isinstance(o, str) and "=" in o for o in ov):
        return "overrides is not a list of key=value"
    values = r.get("values")
    if not isinstance(values, dict) or not all(k.isdigit() and (v is None or _number(v)) for k, v in values.items()):
        return "values is not {step: a number or null}"
    if not (r["dropped_at"] is None or _count(r["dropped_at"])):
        return f"dropped_at {r['dropped_at']!r} is not a step"
    if not (r.get("floor") is None or _number(r["floor"])):
        return f"floor {r['floor']!r} is not a number"
    if not (r["status"] is None or isinstance(r["status"], str)):
        return f"status {r['status']!r} is not a run status"
    return None


def read_screen(path: Path, grid: list[str] | None = None) -> dict | None:
    """A screen's record (decided, or every setting failed), None when it is absent, damaged (named once)
    or, given today's `grid` (its settings' names in order), made on another grid (not taken)."""
    data, problem = _checked_choice(path)
    if problem:
        warn(path, problem, NOT_DECIDED)
    if data is None:
        return None
    return data if grid is None or [r["name"] for r in data["settings"]] == list(grid) else None


def read_choice(path: Path, grid: list[str] | None = None) -> dict | None:
    """A decided screen's record (read_screen) with its chosen setting; None otherwise."""
    data = read_screen(path, grid)
    return data if data and data.get("chosen") else None
