"""The files a study reads, read so that a damaged one never ends the command (issue 37 item 6).

A results.json cut off or not a JSON object, a record whose seed is not an integer, a metrics.csv
with a cell that is not a number, a test.hyp.gz that is not gzip: each is named in one line on
stderr, once per command (`warning: <file>: <what is wrong>: <what the study does>`), and treated
as missing; the study goes on with the other records. The file is left as it is, never rewritten
or deleted: it may be the only copy of a run's result, and whether to restore it (a committed
record: git) or drop it is for a person to decide. So a study does not run again a job whose record
or run folder holds a damaged results.json (runner.damaged_job): training it would replace the file.
--status, --report-only and a study's run read records through here, so they agree on which count.
"""
from __future__ import annotations

import csv
import gzip
import math
import sys
import zlib
from pathlib import Path

from normlab.json_file import json_kind as _kind, json_object  # noqa: F401 (records and runner read it here)
from normlab.study.record_swap import live

NOT_RECORDED = ("treated as not recorded and left as it is (move it away, or restore it, for the study to "
                "run it again)")
NOT_FINISHED = ("the run is treated as not finished and left as it is (move the file away for the study to "
                "continue it)")
NO_SERIES = "treated as missing: its logged series (curves, plateau, end.* values) are left out"

_named: set[str] = set()  # the files named in this command


def warn(path: Path, problem: str, then: str) -> None:
    """One line per damaged file per command: --status reads a record several times."""
    key = str(Path(path).resolve())
    if key not in _named:
        _named.add(key)
        print(f"warning: {path}: {problem}: {then}", file=sys.stderr, flush=True)


def _number(value, integer: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return integer or math.isfinite(value)


def results_problem(res: dict, record: bool, seed: bool = True) -> str | None:
    """What keeps a results.json from being read (the keys the study computes with), None if nothing.
    record: a study's record; seed: it must name its seed (study.seed; a top-level seed in records
    from before `study` was written), as every record of this study does (another study's record is
    looked up by its identity and takes the seed of the job that adopts it)."""
    study = res.get("study")
    if study is not None and not isinstance(study, dict):
        return f"study is {_kind(study)}, not an object"
    study = study or {}
    for key in ("steps", "wall_s"):
        if res.get(key) is not None and not _number(res[key]):
            return f"{key} {res[key]!r} is not a number"
    if res.get("steps") is not None and res["steps"] < 0:  # (a negative wall_s: a clock stepped back, not damage)
        return f"steps {res['steps']!r} is negative"
    if res.get("status") is not None and not isinstance(res["status"], str):
        return f"status is {_kind(res['status'])}, not a run status"
    if res.get("shared_from") and not isinstance(res["shared_from"], dict):
        return f"shared_from is {_kind(res['shared_from'])}, not an object"
    if not record:
        return None
    if res.get("identity_hash") is not None and not isinstance(res["identity_hash"], str):
        return f"identity_hash {res['identity_hash']!r} is not a hash"
    if res.get("rung") is not None and not (_number(res["rung"], integer=True) and res["rung"] > 0):
        return f"rung {res['rung']!r} is not a step"
    if res.get("rung") is not None and res.get("status") == "stopped" and res["rung"] > (res.get("steps") or 0):
        return f"rung {res['rung']} is past the run's steps ({res.get('steps')}): a paused run is at its rung or past it"
    if study.get("jobs") is not None and not _number(study["jobs"], integer=True):
        return f"study.jobs {study['jobs']!r} is not an integer"
    value = study.get("seed", res.get("seed"))
    if seed and value is None:
        return "no seed (study.seed)"
    if value is not None and not _number(value, integer=True):
        return f"study.seed {value!r} is not an integer"
    return None


def read_results(path: Path, record: bool, seed: bool = True) -> dict | None:
    """A results.json as a dict; None when there is none, or when it is damaged (then named once).
    record: a study's record (its seed checked too, unless not `seed`), else a run folder's; a record
    whose write stopped between its renames is read from its `.old` folder (record_swap)."""
    if record:
        path = live(Path(path).parent) / Path(path).name
    res, problem = json_object(path)
    if res is not None:
        problem = results_problem(res, record, seed)
    if problem:
        warn(path, problem, NOT_RECORDED if record else NOT_FINISHED)
        return None
    return res


def is_damaged(path: Path, record: bool) -> bool:
    """A results.json that is there and cannot be read as one (named once): a file that does not read,
    or something else in its place (a folder; a file where its folder should be), which a run or a
    record written there would replace."""
    path = Path(path)
    there = path.exists() or (path.parent.exists() and not path.parent.is_dir())
    return there and read_results(path, record) is None


def read_metrics(path: Path) -> list[dict[str, float]] | None:
    """metrics.csv's rows, each {column: value} without its empty cells, `step` an int; None when it
    is absent, or damaged (a cell that is not a number: named once)."""
    rows = []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                vals = {}
                for key, text in row.items():
                    if key is None or text in (None, ""):  # cells beyond the header's: under no column
                        continue
                    try:
                        vals[key] = int(text) if key == "step" else float(text)
                    except ValueError:
                        what = "an integer" if key == "step" else "a number"
                        return _bad_metrics(path, f"line {reader.line_num}: {key} {text!r} is not {what}")
                rows.append(vals)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        return _bad_metrics(path, f"unreadable ({e})")
    return rows


def _bad_metrics(path: Path, problem: str) -> None:
    warn(path, problem, NO_SERIES)
    return None


def read_text(path: Path, then: str) -> str | None:
    """A text file (gzip when it ends in .gz), None when it is absent, or damaged: not gzip,
    cut off, not UTF-8 (named once, with `then`: what the study does without it)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except EOFError:
        problem = "cut off (its gzip stream ends early)"
    except UnicodeDecodeError as e:
        problem = f"not UTF-8 text (at byte {e.start})"
    except gzip.BadGzipFile as e:  # not gzip at all, or a damaged header or checksum
        problem = "not a gzip file" if str(e).startswith("Not a gzipped file") else f"damaged gzip ({e})"
    except (OSError, zlib.error) as e:
        problem = f"unreadable ({e})"
    warn(path, problem, then)
    return None
