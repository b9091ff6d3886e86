"""Reading W&B's own run files (<run>/wandb/*/run-<id>.wandb), the one place normlab does.

The format is wandb's, not a public API: the LevelDB log format (a 7-byte file header, 32 KiB
blocks, a 7-byte header per chunk) around `wandb_internal_pb2.Record` messages. It is read for two
facts: the last training step a run's earlier legs logged, so a continued run does not log the
steps between its checkpoint and the kill a second time (a W&B run only appends), and whether a
finished run's file holds its exit record yet (wait_until_finished). What a killed
process had not flushed is not in the file, and is logged again: nothing is lost either way.
tests/test_loggers.py reads a file the pinned wandb writes, so a change of format fails there.
"""
from __future__ import annotations

import json
import logging
import struct
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger("normlab")

STEP_KEY = "trainer/global_step"  # Lightning's WandbLogger logs the step as this series


HEADER = 7  # the file's header (":W&B", magic, version) and each chunk's (crc32, length, type) alike
BLOCK = 32768


class RunFileReader:
    """Reads a run file's records from where it last stopped, as wandb's own datastore scans it: a
    chunk is taken only once all of it is in the file, so a file that is still being written is read
    again from the first chunk it did not hold whole, and what was read before is not parsed again.
    A chunk cut by a kill (or a record that does not parse) ends what can be read: nothing after it
    was written either."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos, self.buf = Path(path), HEADER, b""

    def read(self) -> Iterator:
        """The records appended since the last read (all of them, the first time)."""
        from wandb.proto import wandb_internal_pb2 as pb

        with self.path.open("rb") as f:
            f.seek(self.pos)
            data = f.read()
        start, at = self.pos, 0  # at: offset in data; the file offset is start + at
        while True:
            pos = start + at
            if BLOCK - pos % BLOCK < HEADER:  # block trailer: too short for a chunk header
                at += BLOCK - pos % BLOCK
                continue
            if at + HEADER > len(data):
                return
            _, n, kind = struct.unpack("<IHB", data[at:at + HEADER])
            if n == 0 and kind == 0:  # zero padding after the last record of a killed writer
                return
            chunk = data[at + HEADER:at + HEADER + n]
            if len(chunk) < n:  # not all written yet (or cut by a kill)
                return
            if kind in (1, 4):  # full / last chunk
                rec = pb.Record()
                try:
                    rec.ParseFromString(self.buf + chunk if kind == 4 else chunk)
                except Exception:  # a record the kill cut: nothing after it was written either
                    return
                self.buf = b""
            elif kind in (2, 3):  # first / middle chunk
                self.buf += chunk
            at += HEADER + n
            self.pos = start + at  # past a whole chunk: the next read starts here
            if kind in (1, 4):
                yield rec


def records(path: Path) -> Iterator:
    """The records of one run file, in order; a chunk cut by a kill ends the iteration."""
    return RunFileReader(path).read()


def history_steps(path: Path) -> Iterator[int]:
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            for item in rec.history.item:
                if (item.key or "/".join(item.nested_key)) == STEP_KEY:
                    yield int(json.loads(item.value_json))


def last_logged_step(wandb_dir: Path) -> int:
    """The highest training step in the history of every run file under wandb_dir; -1 if none."""
    steps = [s for path in wandb_dir.glob("*/run-*.wandb") for s in history_steps(path)]
    return max(steps, default=-1)


def wait_until_finished(run_folder: Path, timeout: float = 30.0) -> bool:
    """Wait (at most `timeout` s) until the run file in an offline run's folder holds its exit record.
    wandb.finish hands the run to the wandb-core service, which writes the file in its own process and
    is told to close it without being waited for (wandb_run: service.inform_finish); a reader right
    after finish, on a loaded machine, can find the file without its records, even without its first
    `run` record (tests/test_study_labels.py once read the run's group as None). Each look reads only
    what was appended since the last one, and the looks grow apart (50 ms to 1 s): a long run's file
    is megabytes, and this runs while a SIGTERM waits (loggers.finish_loggers). On timeout, one
    warning line and False: the run's result is whole either way, only its upload may lack records."""
    deadline, pause = time.monotonic() + timeout, 0.05
    readers: dict[Path, RunFileReader] = {}
    done: set[Path] = set()
    while True:
        files = sorted(Path(run_folder).glob("run-*.wandb"))
        for f in files:
            if f not in readers:
                readers[f] = RunFileReader(f)
            if f not in done and any(r.WhichOneof("record_type") == "exit" for r in readers[f].read()):
                done.add(f)
        if files and done.issuperset(files):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            where = ", ".join(str(f) for f in files if f not in done) or f"{run_folder}/run-*.wandb (none yet)"
            log.warning("W&B offline run file %s has no exit record after %g s: `wandb sync` may miss its "
                        "last records", where, timeout)
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 1.5, 1.0)
