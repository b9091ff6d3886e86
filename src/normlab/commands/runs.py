"""The runs on this machine, one line each: status, corpus, norm, arm, study, seed and scores.

    python -m normlab.commands.runs                       # outputs/, multirun/ and studies/runs/
    python -m normlab.commands.runs multirun/deep_stack-1a2b3c4d --status completed --sort test_bleu
    python -m normlab.commands.runs studies/runs --json

A run folder is a folder holding run.json, results.json or .hydra/config.yaml; any other folder is
searched for them (a sweep's jobs, a study's runs), hidden folders and the insides of run folders
left out. Each row reads what the run wrote (README, "What a run leaves behind"):

- status: `training` while a live process holds the folder (its .lock: normlab/run_folder.py; a lock
  file a killed run left behind holds nothing), else results.json's status (normlab/outcome.py:
  completed, diverged, stalled, stopped, preempted, failed, interrupted, debug), else `no record`
  (a job that has not written results.json: not started yet, or killed before its end); a
  results.json, run.json or .hydra/config.yaml that cannot be read makes it `damaged: <file>: <what>`
  (the file is left as it is; the row shows what the other files say);
- steps: results.json's steps of planned_steps; a run without a record, or one training now, shows
  its newest full checkpoint's step when that is further (the step a rerun continues from);
- corpus, norm, arm: the labels results.json holds (from the resolved values: normlab/identity.py),
  else computed from run.json's identity; arm and study: a study record's (experiments/<study>/runs/:
  the study and arm that hold the run), else the config's labels.arm / labels.study when the run was
  started with them (normlab-study sets them: the study and arm it was trained as), else a study
  run's W&B group (study-<name>, in results.json or the config); `-` when absent;
- valid BLEU, test BLEU (the scored checkpoint, beam 4), wall (over all legs), started (run.json's
  creation time; the oldest of the run's files for a folder without one).

Rows are sorted by start time, newest last; --sort KEY sorts by another column (ascending, absent
values first). --json prints the rows as a JSON list with the raw values (path, planned_steps and
problem added) for scripts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from normlab import identity
from normlab.commands.common import CommandError, CommandParser, main_guard
from normlab.commands.study import SHARED_RUNS
from normlab.outcome import Status
from normlab.run_folder import CREATED_FORMAT, MULTIRUN, OUTPUTS, RUN_FILE, full_checkpoints, held_elsewhere
from normlab.study.damaged import json_object, results_problem
from normlab.study.records import holding_study

DEFAULT_FOLDERS = (OUTPUTS, MULTIRUN, str(SHARED_RUNS))  # where train.py and normlab-study put run folders
TRAINING, NO_RECORD, DAMAGED = "training", "no record", "damaged"
STATUSES = (TRAINING, *(s.value for s in Status), NO_RECORD, DAMAGED)
# (JSON key, table header); the JSON keys are the --sort keys
COLUMNS = (("run", "run"), ("status", "status"), ("steps", "steps"), ("corpus", "corpus"), ("norm", "norm"),
           ("arm", "arm"), ("study", "study"), ("seed", "seed"), ("valid_bleu", "valid BLEU"),
           ("test_bleu", "test BLEU"), ("wall_s", "wall"), ("started", "started"))
SORT_KEYS = tuple(key for key, _ in COLUMNS)
ABSENT = "-"


# ---------------------------------------------------------------- finding run folders

def is_run_folder(path: Path, files: list[str]) -> bool:
    return RUN_FILE in files or "results.json" in files or os.path.isfile(path / ".hydra" / "config.yaml")


def run_folders(root: Path) -> list[Path]:
    """The run folders at or below root: a run folder's own subfolders (checkpoints, wandb, csv) are
    not searched; a folder that cannot be listed is passed over (os.walk's default)."""
    found = []
    for top, dirs, files in os.walk(root):
        top_path = Path(top)
        if is_run_folder(top_path, files):
            found.append(top_path)
            dirs[:] = []
        else:  # hidden: .hydra, and a study's record being written (study/runner.py's temp folder)
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return found


# ---------------------------------------------------------------- reading one run folder

def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _read_config(path: Path) -> tuple[dict, str | None]:
    """.hydra/config.yaml as plain data (interpolations left as text), or what is wrong with it."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"unreadable ({e.strerror or e})"
    except UnicodeDecodeError as e:
        return {}, f"not text (not UTF-8 at byte {e.start})"
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        return {}, f"not YAML (line {mark.line + 1})" if mark else "not YAML"
    if data is not None and not isinstance(data, dict):
        return {}, f"a YAML {type(data).__name__}, not a mapping"
    return data or {}, None


def _read(folder: Path) -> tuple[dict, dict, dict, list[str]]:
    """(results.json, run.json, config) of a run folder, {} for each one absent or damaged, and a
    line per damaged file."""
    problems = []
    results, problem = json_object(folder / "results.json")
    if results is not None:
        problem = results_problem(results, record=False)
    if problem:
        problems.append(f"results.json: {problem}")
    record, record_problem = json_object(folder / RUN_FILE)
    if record_problem:
        problems.append(f"{RUN_FILE}: {record_problem}")
    config, config_problem = _read_config(folder / ".hydra" / "config.yaml")
    if config_problem:
        problems.append(f".hydra/config.yaml: {config_problem}")
    return (results or {}) if not problem else {}, record or {}, config, problems


def _computed_labels(record: dict, config: dict) -> dict:
    """Labels from the resolved values of a run whose results.json has none (not finished yet):
    run.json's identity, else the config (its interpolations unresolved: best effort)."""
    for values in (_dict(record.get("identity")), config):
        if values:
            try:
                return identity.labels(values)
            except Exception:  # an old or odd record: the row shows `-` rather than stop the listing
                continue
    return {}


def _started(folder: Path, record: dict) -> str:
    created = record.get("created")
    try:
        time.strptime(str(created), CREATED_FORMAT)
        return str(created)
    except ValueError:
        pass
    for name in (".hydra/config.yaml", RUN_FILE, "results.json", "."):  # the first written first
        try:
            return time.strftime(CREATED_FORMAT, time.localtime((folder / name).stat().st_mtime))
        except OSError:
            continue
    return ""


def checkpoint_step(folder: Path) -> int | None:
    """The newest full checkpoint's step, from its name (run_folder.full_checkpoints: Lightning is
    not imported, seconds of a listing's start)."""
    found = full_checkpoints(folder / "checkpoints")
    return found[0][0] if found else None


def _study_of_group(group: Any) -> str | None:
    # the study runner groups its runs as study-<name> (identity.study_group)
    prefix = identity.STUDY_GROUP_PREFIX
    return group[len(prefix):] if isinstance(group, str) and group.startswith(prefix) else None


def read_row(folder: Path, shown: str) -> dict:
    results, record, config, problems = _read(folder)
    res_labels, given = _dict(results.get("labels")), _dict(config.get("labels"))
    labels = res_labels  # a record from before a label existed (the corpus's): the others computed
    if not all(labels.get(k) for k in ("data", "norm", "arm")):
        labels = {**_computed_labels(record, config), **{k: v for k, v in res_labels.items() if v}}
    study_record = _dict(results.get("study"))  # a study's record (experiments/<study>/runs/)
    if held_elsewhere(folder):
        status = TRAINING
    elif problems:
        status = f"{DAMAGED}: {'; '.join(problems)}"
    else:
        status = str(results["status"]) if results.get("status") is not None else NO_RECORD
    steps = _number(results.get("steps"))
    if status in (TRAINING, NO_RECORD):
        ckpt = checkpoint_step(folder)
        steps = ckpt if ckpt is not None and (steps is None or ckpt > steps) else steps
    planned = _number(results.get("planned_steps")) or _number(_dict(config.get("trainer")).get("max_steps"))
    seed = next((s for s in (results.get("seed"), config.get("seed"), _dict(record.get("identity")).get("seed"))
                 if isinstance(s, int) and not isinstance(s, bool)), None)
    return {"run": shown, "path": str(folder.resolve()), "status": status, "steps": steps, "planned_steps": planned,
            "corpus": labels.get("data"), "norm": labels.get("norm"),
            # a study's record names the study and arm that hold the run; the labels, the ones it
            # was trained as (another study's, for a run two studies share: docs/studies.md)
            "arm": study_record.get("arm") or given.get("arm") or labels.get("arm"),
            "study": holding_study(folder, results) or given.get("study") or res_labels.get("study")
            or _study_of_group(results.get("group") or config.get("group")),
            "seed": seed, "valid_bleu": _number(results.get("valid_bleu")),
            "test_bleu": _number(results.get("test_bleu")), "wall_s": _number(results.get("wall_s")),
            "started": _started(folder, record), "problem": "; ".join(problems) or None}


def find_rows(roots: list[str]) -> list[dict]:
    rows = []
    for root in roots:
        base = Path(root)
        for folder in run_folders(base):
            rel = folder.relative_to(base)
            rows.append(read_row(folder, str(base / rel) if rel.parts else root))
    return rows


# ---------------------------------------------------------------- choosing and showing rows

def status_filter(text: str) -> set[str]:
    wanted = {w.strip().replace("_", " ").replace("-", " ") for w in text.split(",") if w.strip()}
    unknown = sorted(wanted - set(STATUSES))
    if unknown or not wanted:
        raise CommandError(f"--status={text}", f"no such status {', '.join(unknown) or '(empty)'}", STATUSES)
    return wanted


def kept(row: dict, wanted: set[str]) -> bool:
    return row["status"] in wanted or (DAMAGED in wanted and row["status"].startswith(f"{DAMAGED}:"))


def sort_rows(rows: list[dict], key: str) -> list[dict]:
    # absent values first, so the newest run / the best score is the last line, next to the prompt;
    # numbers before text where a column holds both (a status), then the start time
    def order(row: dict):
        v = row[key]
        rank = (0, 0, "") if v is None else (1, v, "") if _number(v) is not None else (2, 0, str(v))
        return rank, row["started"], row["run"]

    return sorted(rows, key=order)


def _wall(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def cell(row: dict, key: str) -> str:
    v = row[key]
    if v is None or v == "":
        return ABSENT
    if key == "steps":
        return f"{v}/{row['planned_steps']}" if row["planned_steps"] is not None else str(v)
    if key in ("valid_bleu", "test_bleu"):
        return f"{v:.2f}"
    if key == "wall_s":
        return _wall(v)
    return str(v)


def table(rows: list[dict]) -> str:
    lines = [[header for _, header in COLUMNS]] + [[cell(r, key) for key, _ in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip() for line in lines) + "\n"


def summary(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        word = DAMAGED if r["status"].startswith(f"{DAMAGED}:") else r["status"]
        counts[word] = counts.get(word, 0) + 1
    order = sorted(counts, key=lambda w: (STATUSES.index(w) if w in STATUSES else len(STATUSES), w))
    return f"{len(rows)} run{'s' * (len(rows) != 1)}: " + ", ".join(f"{counts[w]} {w}" for w in order)


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(prog="python -m normlab.commands.runs", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("folders", nargs="*", help=f"folders to search (default: {', '.join(DEFAULT_FOLDERS)} where "
                                               "they exist)")
    ap.add_argument("--sort", default="started", metavar="KEY",
                    help=f"sort by this column (default: started): {', '.join(SORT_KEYS)}")
    ap.add_argument("--status", metavar="STATUS[,STATUS]", help=f"only these statuses: {', '.join(STATUSES)}")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    args = ap.parse_args(argv)
    if args.sort not in SORT_KEYS:
        raise CommandError(f"--sort={args.sort}", "no such column", SORT_KEYS)
    wanted = status_filter(args.status) if args.status is not None else None
    for folder in args.folders:
        if not Path(folder).is_dir():
            raise CommandError(folder, "no such folder" if not Path(folder).exists() else "not a folder")
    roots = args.folders or [f for f in DEFAULT_FOLDERS if Path(f).is_dir()]
    rows = find_rows(roots)
    shown = sort_rows([r for r in rows if wanted is None or kept(r, wanted)], args.sort)
    if args.json:
        print(json.dumps(shown, indent=2))
    elif shown:
        print(table(shown), end="")
    where = ", ".join(roots) if roots else f"here (none of {', '.join(DEFAULT_FOLDERS)} exists)"
    if not rows:
        print(f"no runs below {where}: a run folder holds run.json, results.json or .hydra/config.yaml",
              file=sys.stderr)
    elif not shown:
        print(f"no runs with status {args.status} ({summary(rows)})", file=sys.stderr)
    else:
        print(summary(shown) + ("" if len(shown) == len(rows) else f" (of {len(rows)})"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_guard(main))
