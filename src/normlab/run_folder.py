"""A run's folder: where it is, whose it is, whether the run is finished and where it continues from.

`run.json` records the run's identity (identity.py): its hash, the resolved identity values, the
name and the W&B run id. Rerunning a command finds the folder from the identity (conf/hydra) and:
- a finished run (results.json status completed or diverged) is not trained again: one line says
  so (`retrain=true` trains it again from step 0, as a new W&B run);
- an unfinished one continues from its newest readable full-state checkpoint (an unreadable one,
  e.g. truncated by a kill during the write, is skipped; temp files of interrupted writes are
  removed), in the same W&B run, with the CSV history cut at the checkpoint's step so the curve
  continues without duplicates;
- a folder holding another identity (an explicit run_dir reused for a different config) is an
  error that names the keys that differ.
"""
from __future__ import annotations

import csv
import fcntl
import functools
import os
import socket
from contextlib import contextmanager
import hashlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.checkpoint import write_json
from normlab.config import ConfigError
from normlab.json_file import json_object
from normlab.outcome import FINISHED  # results: not trained again

log = logging.getLogger("normlab")
RUN_FILE = "run.json"
OUTPUTS, MULTIRUN = "outputs", "multirun"  # single runs' and sweeps' folders (conf/hydra/default.yaml's run.dir, sweep.dir)
FULL_PREFIX = "full-step"  # checkpoints/full-step<N>.ckpt: the full-state checkpoints (callbacks/full_checkpoint.py)
CREATED_FORMAT = "%Y-%m-%d %H:%M:%S"  # run.json's `created` (and the lock's `since`): sorts as text in time order
PRODUCTS = ("checkpoints", "csv", "results.json", "test.hyp", "admin_omega.json")  # removed by retrain=true


def readable(path: Path) -> dict | None:
    """The checkpoint if it loads (weights only, memory-mapped), else None."""
    from normlab.checkpoint import CheckpointError, load_checkpoint

    try:
        return load_checkpoint(path, mmap=True)
    except CheckpointError as e:  # truncated, empty, not a checkpoint, unsafe
        log.warning("skipping unreadable checkpoint %s: %s", path, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def full_checkpoints(ckdir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the full-state checkpoints in a folder, newest first."""
    found = []
    for p in Path(ckdir).glob(f"{FULL_PREFIX}*.ckpt"):
        digits = p.stem[len(FULL_PREFIX):]
        if digits.isdigit():
            found.append((int(digits), p))
    return sorted(found, reverse=True)


def start_checkpoint_path(path: str, resume: bool) -> Path:
    """The checkpoint a `resume=` / `finetune=` value names: a file, or a run folder's newest full
    checkpoint (resume) or its best checkpoint, else last.ckpt (finetune)."""
    from normlab.checkpoint import resolve_checkpoint

    key = "resume" if resume else "finetune"
    p = Path(path)
    if p.is_dir() and resume:
        ckdir = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        for _, cand in full_checkpoints(ckdir):
            if readable(cand) is not None:
                return cand
    try:
        return resolve_checkpoint(p)
    except FileNotFoundError as e:
        raise ConfigError(f"{key}={path}: {e}") from None


@functools.lru_cache(maxsize=8)
def _checkpoint_summary(path: str, mtime: float) -> tuple[dict, bool]:
    from normlab.checkpoint import load_checkpoint

    ckpt = load_checkpoint(path, mmap=True)  # unreadable or unsafe: CheckpointError, one line naming the file
    if "model_config" not in ckpt:
        raise ConfigError(f"{path}: not a normlab checkpoint (no model_config)")
    return dict(ckpt["model_config"]), "optimizer_states" in ckpt and "loops" in ckpt


def start_checkpoint_model(path: str, resume: bool) -> tuple[Path, dict[str, Any]]:
    """The checkpoint a `resume=` / `finetune=` value names (start_checkpoint_path) and its model
    settings as Hydra keys (model.*, norm.*, regularizer.*, init.name, data.vocab_size). resume=True
    also requires a full-state checkpoint. The one place naming reads a checkpoint (run_identity
    merges the settings in; identity.py reads nothing)."""
    ck = start_checkpoint_path(path, resume)
    model, full = _checkpoint_summary(str(ck.resolve()), ck.stat().st_mtime)
    if resume and not full:
        raise ConfigError(f"resume={path}: {ck.name} holds weights only (no optimizer state); "
                          f"finetune={path} starts from its weights with a fresh optimizer")
    out: dict[str, Any] = {}
    for key, value in model.items():
        if key in ("norm", "regularizer"):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        elif key == "init":
            out["init.name"] = value
        elif key == "vocab_size":
            out["data.vocab_size"] = value
        elif key not in ("pad_id", "bos_id", "eos_id"):
            out[f"model.{key}"] = value
    return ck, out


def existing_name(parent: str | Path, name: str) -> str:
    """`name`, or the folder an earlier release named for the same identity (the same hash after
    another readable part, e.g. before the corpus was in names), so its runs continue or are
    skipped instead of being trained again in a new folder."""
    parent = Path(parent)
    if (parent / name).exists() or not parent.is_dir():
        return name
    digest = name.rsplit("-", 1)[-1]
    for cand in sorted(parent.glob(f"*-{digest}")):
        if holds_run(cand, digest):
            return cand.name
    return name


def holds_run(folder: Path, identity_hash: str) -> bool:
    """Whether `folder`'s run.json records this identity (train.run wrote it with the run's hash); a
    damaged run.json is not this run's."""
    return (json_object(folder / RUN_FILE)[0] or {}).get("identity_hash") == identity_hash


def _read_json(path: Path) -> dict:
    """run.json or results.json as a dict; {} when it is absent, or damaged (cut off, not JSON, or JSON
    that is not an object, e.g. a list): then named in one warning line and treated as missing, so
    the run trains (or continues) and writes the file anew."""
    value, problem = json_object(path)
    if problem is not None:
        log.warning("%s: %s: treated as missing (the run writes it anew)", path, problem)
    return value or {}


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


@dataclass
class Continuation:
    run_dir: Path
    record: dict  # run.json
    finished: dict | None = None  # results.json of a finished run
    checkpoint: Path | None = None  # the newest readable full-state checkpoint
    step: int = 0  # its global step

    @property
    def wandb_id(self) -> str:
        return self.record["wandb_id"]


def prepare(run_dir: Path, ident: dict, ident_hash: str, name: str, retrain: bool, rank_zero: bool = True) -> Continuation:
    record = _read_json(run_dir / RUN_FILE)
    if record and record.get("identity_hash") != ident_hash and not retrain:
        old, new = _flat(record.get("identity") or {}), _flat(ident)
        differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        shown = ", ".join(f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in differ[:4]) + (" ..." if len(differ) > 4 else "")
        raise ConfigError(f"run_dir={run_dir}: holds another run ({record.get('name')}), which differs in {shown}; "
                          "choose another run_dir or name, or pass retrain=true to replace it")
    results = _read_json(run_dir / "results.json")
    attempt = int(record.get("attempt", 0)) if record.get("identity_hash") == ident_hash else 0
    if retrain:
        if rank_zero:
            for item in PRODUCTS:
                p = run_dir / item
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        attempt, results = attempt + 1 if record else 0, {}
    out = Continuation(run_dir, record)
    if results.get("status") in FINISHED:
        out.finished = results
        return out
    ckdir = run_dir / "checkpoints"
    if rank_zero:
        for tmp in ckdir.glob(".*.tmp"):  # an atomic write killed before its rename
            tmp.unlink(missing_ok=True)
    # retrain starts from step 0 on every rank: rank 0 wipes the folder, and a rank started beside it
    # (torchrun, SLURM) must not pick up a checkpoint it has not deleted yet
    for step, path in [] if retrain else full_checkpoints(ckdir):
        if readable(path) is not None:
            out.checkpoint, out.step = path, step
            break
    key = f"{ident_hash}:{run_dir.resolve()}:{attempt}"
    out.record = {"identity_hash": ident_hash, "name": name, "attempt": attempt, "identity": ident,
                  "wandb_id": record.get("wandb_id") if attempt == record.get("attempt", 0) and record.get("wandb_id")
                  and record.get("identity_hash") == ident_hash else hashlib.sha256(key.encode()).hexdigest()[:16],
                  "created": record.get("created") or time.strftime(CREATED_FORMAT)}
    if rank_zero:
        write_json(run_dir / RUN_FILE, out.record)
    return out


# ---------------------------------------------------------------- one process per run folder

LOCK_FILE = ".lock"


class RunFolderInUse(ConfigError):
    """Another process holds the run folder: nothing of this attempt is written into it."""


def held_elsewhere(run_dir: Path) -> bool:
    """Whether another process holds the folder now (locked()): a shared probe of its lock file."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def held_here(run_dir: Path) -> bool:
    """Whether this process holds the folder (locked()): a failed run's record is written while it does."""
    return os.path.abspath(run_dir) in _HELD


def _same_file(fd: int, path: Path) -> bool:
    """Whether fd is still the file at path (a holder removes its lock file when it ends)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


_HELD: set[str] = set()  # the folders this process holds (locked() inside locked(): already held)


def rank_zero() -> bool:
    """Before a trainer exists: rank from the launcher's environment (DDP children, SLURM, torchrun)."""
    return all(int(os.environ.get(k, "0") or 0) == 0 for k in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


@contextmanager
def locked(run_dir: Path, rank_zero: bool = True):
    """Hold the run folder for this process: a second copy of the same command (same identity, so
    the same folder) stops with one line naming the holder instead of training into the same files.
    An OS lock (flock): a killed holder's lock is released by the kernel and taken over by the next
    run; the file is removed when the holder is done. Ranks other than 0 share rank 0's folder.
    Taken by the training command before anything is written into the folder (commands/train.py),
    and again by train.run for callers without it: the inner one holds nothing more."""
    key = os.path.abspath(run_dir)
    if not rank_zero or key in _HELD:
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    # 0o666 under the umask: a lock file left by a killed holder is opened by a colleague's rerun
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    for wait in (0.02, 0.05, 0.1, 0.2, None):  # a probe's brief shared lock (held_elsewhere) is not a holder
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if wait is not None:
                time.sleep(wait)
            continue
        if _same_file(fd, path):
            break
        # the holder ended meanwhile and removed the file this fd locks: lock the folder's file anew
        os.close(fd)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    else:
        holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunFolderInUse(f"{run_dir}: in use by {holder} (the same run started twice); wait for it to end or "
                          "stop it, then rerun to continue") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} on {socket.gethostname()} since {time.strftime(CREATED_FORMAT)}"
             .encode())
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        try:
            os.unlink(path)  # while still held: no other process can take a lock on a file about to vanish
        except OSError:
            pass
        os.close(fd)


# ---------------------------------------------------------------- one continuous CSV history

def csv_histories(run_dir: Path, step: int) -> dict[Path, tuple[list[str], list[dict]]]:
    """The rows of every metrics.csv in the run folder logged before `step` (the continuation's
    first step), with their header. Read before the loggers start: Lightning's CSV logger deletes
    an existing metrics.csv when it opens its folder."""
    out = {}
    for path in run_dir.rglob("metrics.csv"):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows = [r for r in reader if r.get("step", "").isdigit() and int(r["step"]) < step]
            out[path.resolve()] = (list(reader.fieldnames or []), rows)
    return out


def restore_csv_histories(loggers: list, histories: dict) -> None:
    from lightning.pytorch.loggers import CSVLogger

    for logger in loggers:
        if not isinstance(logger, CSVLogger):
            continue
        writer = logger.experiment  # opening it deletes the old file (a stand-in on ranks other than 0)
        path = getattr(writer, "metrics_file_path", None)
        if not isinstance(path, str) or Path(path).resolve() not in histories:
            continue
        path = Path(path).resolve()
        header, rows = histories[path]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            w.writerows(rows)
        writer.metrics_keys = sorted(header)  # new keys are merged into this header, not replace it
