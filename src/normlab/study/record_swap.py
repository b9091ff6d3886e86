"""A record folder written whole (runner.write_record, runner.adopt_shared, screen_run.adopt_rung).

The new record is filled in a temp folder `.<name>.tmp` and swapped in by two renames: the old record
to `.<name>.old`, the new one into place; then `.old` is removed. So a reader never finds half a
record, and the old record is kept until the new one is complete: a crash while filling leaves the
old record in place (and a `.tmp` that the next write clears); a crash between the two renames leaves
only `.old`, a whole record. Then this study's readers read `.old` as the record (`live`: results.json
through damaged.read_results, metrics.csv through screen.metrics_csv, the report's load_records),
and the next write of that record puts it back first (`restore`), so nothing is lost. Another study's
indexes of this study's records (runner.shared_index, screen_run.rung_index) skip every `.`-named
folder: for them the record is missing until this study writes it again, which costs at most a run
they train or wait for, never a wrong number; they do not restore it themselves, as a rename from
another process could race this study's own swap.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable


def side(folder: Path, kind: str) -> Path:
    """The record's temp (`tmp`) or previous (`old`) folder beside it: `.`-named, so no index reads it."""
    return folder.with_name(f".{folder.name}.{kind}")


def live(folder: Path) -> Path:
    """The folder a record is read from: itself, or its `.old` where a swap stopped between its renames."""
    folder = Path(folder)
    old = side(folder, "old")
    return old if not folder.exists() and old.is_dir() else folder


def restore(folder: Path) -> None:
    """Put back a record that a swap left as `.old` only (the writer does this, for its own records)."""
    old = side(folder, "old")
    if not folder.exists() and old.is_dir():
        os.replace(old, folder)


def write_record_folder(folder: Path, fill: Callable[[Path], None]) -> None:
    """Write a record folder whole: `fill(tmp)` writes the new record into an empty temp folder, then
    it replaces the old record (module docstring: the old one kept until the new one is in place)."""
    restore(folder)
    tmp, old = side(folder, "tmp"), side(folder, "old")
    shutil.rmtree(tmp, ignore_errors=True)  # a crash's half-filled temp folder
    tmp.mkdir(parents=True)
    fill(tmp)
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
