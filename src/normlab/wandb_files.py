"""Reading W&B's own run files (<run>/wandb/*/run-<id>.wandb), the one place normlab does.

The format is wandb's, not a public API: the LevelDB log format (a 7-byte file header, 32 KiB
blocks, a 7-byte header per chunk) around `wandb_internal_pb2.Record` messages. It is read for one
fact only, the last training step a run's earlier legs logged, so a continued run does not log the
steps between its checkpoint and the kill a second time (a W&B run only appends). What a killed
process had not flushed is not in the file, and is logged again: nothing is lost either way.
tests/test_loggers.py reads a file the pinned wandb writes, so a change of format fails there.
"""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Iterator

STEP_KEY = "trainer/global_step"  # Lightning's WandbLogger logs the step as this series


def records(path: Path) -> Iterator:
    """The records of one run file, in order; a chunk cut by a kill ends the iteration."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer: too short for a chunk header
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # zero padding after the last record of a killed writer
            return
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if len(chunk) < n:
            return
        if kind in (1, 4):  # full / last chunk
            rec = pb.Record()
            try:
                rec.ParseFromString(buf + chunk if kind == 4 else chunk)
            except Exception:  # a record the kill cut: nothing after it was written either
                return
            buf = b""
            yield rec
        elif kind in (2, 3):  # first / middle chunk
            buf += chunk


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


def finished(path: Path) -> bool:
    """Whether the run file holds its run's exit record (the last one wandb.finish has written)."""
    return any(rec.WhichOneof("record_type") == "exit" for rec in records(path))


def wait_until_finished(run_folder: Path, timeout: float = 30.0) -> bool:
    """Wait (at most `timeout` s) until the run file in an offline run's folder holds its exit record.
    wandb.finish hands the run to the wandb-core service, which writes the file in its own process and
    is told to close it without being waited for (wandb_run: service.inform_finish); a reader right
    after finish, on a loaded machine, can find the file without its records, even without its first
    `run` record (tests/test_study_labels.py once read the run's group as None). False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        files = list(Path(run_folder).glob("run-*.wandb"))
        if files and all(finished(f) for f in files):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
