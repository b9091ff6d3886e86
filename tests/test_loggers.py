"""Loggers from config, several at once (W&B offline + CSV by default, TensorBoard as an option);
one score per key, logged once; the W&B summary equals results.json key for key."""
import csv
import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from normlab import loggers
from normlab.loggers import build_loggers, finish_loggers, wandb_summary
from normlab.train import run

from conftest import compose_cfg, tiny_overrides, wandb_records


def loggers_of(choice: str):
    return compose_cfg([f"logger={choice}"]).get("logger")


def test_logger_choices_compose():
    assert set(loggers_of("[wandb,csv]")) == set(compose_cfg([]).logger) == {"wandb", "csv"}  # the default
    assert set(loggers_of("csv")) == {"csv"}
    assert set(loggers_of("[wandb,csv,tensorboard]")) == {"wandb", "csv", "tensorboard"}
    assert set(compose_cfg(["+logger=tensorboard"]).logger) == {"wandb", "csv", "tensorboard"}
    assert not loggers_of("none")


def test_wandb_offline_run_is_written_without_network(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    (logger,) = build_loggers(loggers_of("wandb"), tmp_path, "normlab-test", "prenorm-x", "grp",
                              ["norm:prenorm", "seed:1"], config={"norm": {"placement": "pre"}}, run_id="abc123")
    logger.log_metrics({"train/loss": 1.5}, step=1)
    run = logger.experiment
    assert run.settings.mode == "offline" and run.id == "abc123"
    assert (run.name, run.group) == ("prenorm-x", "grp")
    assert set(run.tags) == {"norm:prenorm", "seed:1"}
    assert run.config["norm"]["placement"] == "pre"
    import wandb

    real_finish = wandb.finish
    monkeypatch.setattr(wandb, "finish", lambda exit_code=0: None)  # read the summary before the run closes
    # the run stays open, so its file never gets the exit record finish_loggers waits for (30 s): note the wait
    waited = []
    monkeypatch.setattr(loggers, "wait_until_finished", waited.append)
    finish_loggers([logger], {"status": "diverged", "test_bleu": None, "steps": 7, "choices": {"norm": "x"}})
    assert run.summary["status"] == "diverged" and run.summary["steps"] == 7 and run.summary["choices"]["norm"] == "x"
    assert waited == [Path(run.sync_dir)]  # an offline run: its file waited for before anyone reads it
    monkeypatch.setattr(wandb, "finish", real_finish)
    wandb.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_env_wins_over_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = OmegaConf.create({"wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger", "mode": "online"}})
    (logger,) = build_loggers(cfg, tmp_path, "normlab-test", "n", "g", [], config={})
    assert logger.experiment.settings.mode == "disabled"
    finish_loggers([logger])


def test_summary_keys_mirror_results():
    results = {"status": "completed", "valid_bleu": 12.5, "test_bleu_avg": 3.0, "steps": 8, "decoders": {"beam": 4},
               "train_tokens_per_s": 7000.0, "labels": {"norm": "pre_ln"}}
    # every score under one key, the logged series' (no valid_bleu beside valid/bleu, no throughput
    # under two keys); non-scalars too
    assert wandb_summary(results) == {"status": "completed", "steps": 8, "valid/bleu": 12.5, "test/bleu_avg": 3.0,
                                      "decoders": {"beam": 4}, "train/tokens_per_s": 7000.0,
                                      "labels": {"norm": "pre_ln"}}


@pytest.fixture(scope="module")
def three_logger_run(small_corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loggers")
    os.environ["WANDB_MODE"] = "offline"
    cfg = compose_cfg(tiny_overrides(small_corpus, tmp / "run", tmp / "cache")
                      + ["logger=[wandb,csv,tensorboard]", "trainer.max_steps=8", "trainer.val_check_interval=4",
                         "callbacks.step_checkpoints.every_n_steps=4", "callbacks.step_checkpoints.keep_last_n=2"])
    return run(cfg), tmp / "run"


def test_every_logger_writes_into_the_run_folder(three_logger_run):
    results, run_dir = three_logger_run
    assert results["status"] == "completed"
    assert (run_dir / "csv" / "metrics.csv").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 1


def test_one_score_per_key_and_wandb_summary_equals_results(three_logger_run):
    results, run_dir = three_logger_run
    assert json.loads((run_dir / "results.json").read_text()) == results
    # every decode under its own key, with its own value (the bug: test/bleu logged 3 times)
    for key in ("test_bleu", "test_bleu_greedy", "test_bleu_avg", "test_chrf_greedy", "test_loss_avg",
                "valid_bleu", "valid_loss"):
        assert isinstance(results[key], float), key
    (wfile,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history, summary = [], {}
    for rec in wandb_records(wfile):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
    logged = [k for h in history for k in h]
    for key in ("test/bleu", "test/bleu_greedy", "test/bleu_avg", "test/loss", "test/loss_avg"):
        assert logged.count(key) == 1, key
    assert logged.count("valid/bleu") == 2  # once per validation (steps 4 and 8), not again for the final scoring
    for key, value in results.items():  # key for key, and the logged series where results.json has them
        score = key.startswith(("valid_", "test_", "train_"))
        assert summary[key.replace("_", "/", 1) if score else key] == value, key  # non-scalars included
        assert not score or key not in summary, key  # one key per score
    last = {k: v for h in history for k, v in h.items() if k.startswith("test/")}
    # the final passes log results.json's values themselves (Lightning's loop logged float32)
    assert last == {k: results[k.replace("/", "_", 1)] for k in last}
    # the CSV log has the same single test scores
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    assert [float(r["test/bleu_avg"]) for r in rows if r.get("test/bleu_avg")] == [results["test_bleu_avg"]]
    assert [float(r["test/loss"]) for r in rows if r.get("test/loss")] == [results["test_loss"]]


def test_the_documented_sync_uploads_every_leg_into_one_run(tmp_path, monkeypatch, caplog):
    """docs/runs-that-survive.md: `wandb sync --id <wandb_id> <run>/wandb/offline-run-*` with the pinned wandb (which has
    no `--append`): both legs of a continued offline run, for the one id (a dry run: no network). Each
    leg ends with a line naming its folder and the command; the second leg's is that one, and it runs."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    notes = []
    for leg in range(2):  # a run continued once: two offline legs with the id run.json keeps
        (logger,) = build_loggers(loggers_of("wandb"), tmp_path, "normlab-test", "n", "g", [], config={},
                                  run_id="cont1234")
        logger.log_metrics({"train/loss": 2.0 - leg}, step=leg)
        caplog.clear()
        with caplog.at_level("INFO", logger="normlab"):
            finish_loggers([logger], {"status": "completed" if leg else "preempted"})
        notes += [m for m in caplog.messages if m.startswith("W&B offline run: ")]
        time.sleep(1.1)  # offline folders are named by their start second
    legs = sorted((tmp_path / "wandb").glob("offline-run-*-cont1234"))
    assert len(legs) == 2
    assert notes == [f"W&B offline run: {legs[0]}; upload it with `wandb sync {legs[0]}`",
                     f"W&B offline run: {legs[1]}; upload it with "
                     f"`wandb sync --id cont1234 {tmp_path / 'wandb'}/offline-run-*-cont1234`"]
    wandb_cli = Path(sys.executable).parent / "wandb"
    command = notes[1].split("`")[1].replace("wandb sync", f"{wandb_cli} sync --dry-run", 1)
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "Would sync 2 run(s)" in text, text
    assert text.index(legs[0].name) < text.index(legs[1].name)  # in order of start time


def leveldb_chunk(rec) -> bytes:
    """One W&B record as a full chunk of the run file's LevelDB log (crc left 0: the reader skips it)."""
    import struct

    data = rec.SerializeToString()
    return struct.pack("<IHB", 0, len(data), 1) + data


def test_a_finished_offline_run_is_waited_for_until_its_file_holds_the_exit_record(tmp_path):
    """wandb.finish returns once the wandb-core service has the run's exit, and tells the service to close
    the file without waiting (tests/test_study_labels.py once read an offline run's group as None right
    after the run returned): the run ends only when its file holds the exit record, which a reader then
    finds with the run record before it."""
    import threading
    import time

    from wandb.proto import wandb_internal_pb2 as pb

    from normlab.wandb_files import records, wait_until_finished

    run = pb.Record()
    run.run.run_group = "study-x"
    exit_rec = pb.Record()
    exit_rec.exit.exit_code = 0
    path = tmp_path / "run-abc.wandb"
    path.write_bytes(b":W&B\x00\x00\x01" + leveldb_chunk(run))  # the service has written the run record only
    assert not wait_until_finished(tmp_path, timeout=0.2)

    def close_later():
        time.sleep(0.3)
        with path.open("ab") as f:
            f.write(leveldb_chunk(exit_rec))
    writer = threading.Thread(target=close_later)
    start = time.monotonic()
    writer.start()
    assert wait_until_finished(tmp_path, timeout=10)
    writer.join()
    assert time.monotonic() - start >= 0.3  # returned once the file was whole, not before
    assert [r.WhichOneof("record_type") for r in records(path)] == ["run", "exit"]
    assert not wait_until_finished(tmp_path / "empty", timeout=0.1)  # no run file at all: not finished


def leveldb_log(recs) -> bytes:
    """A whole W&B run file as wandb writes it: the header, then each record in chunks that never cross
    a 32 KiB block (first / middle / last where one does), a block's last < 7 bytes zero-filled."""
    import struct

    out = bytearray(b":W&B\x00\x00\x01")
    for rec in recs:
        data, first = rec.SerializeToString(), True
        while True:
            room = 32768 - len(out) % 32768
            if room < 7:
                out += b"\x00" * room
                continue
            part, data = data[:room - 7], data[room - 7:]
            kind = (1 if first else 4) if not data else (2 if first else 3)
            out += struct.pack("<IHB", 0, len(part), kind) + part
            first = False
            if not data:
                break
    return bytes(out)


def test_waiting_for_the_exit_record_reads_each_byte_of_the_run_file_about_once(tmp_path, monkeypatch):
    """A long run's file is megabytes and the wait runs while a SIGTERM is deferred: each look reads only
    what was appended since the last, taking a chunk only once it is whole (records across blocks too)."""
    import pathlib
    import threading

    from wandb.proto import wandb_internal_pb2 as pb

    from normlab.wandb_files import records, wait_until_finished

    recs = [pb.Record()]
    recs[0].run.run_group = "study-x"
    for step in range(120):  # ~120 KiB: four blocks, records split across them
        rec = pb.Record()
        item = rec.history.item.add()
        item.key, item.value_json = "trainer/global_step", str(step)
        rec.history.item.add(key="pad", value_json='"' + "x" * 1000 + '"')
        recs.append(rec)
    recs.append(pb.Record())
    recs[-1].exit.exit_code = 0
    data, path = leveldb_log(recs), tmp_path / "run-abc.wandb"
    cut = len(data) - 7 - len(recs[-1].SerializeToString()) - 20  # inside the last history record's chunk
    path.write_bytes(data[:cut])

    read, looked = [0], threading.Semaphore(0)
    real_open = pathlib.Path.open

    class Counted:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
            looked.release()

        def seek(self, *a):
            return self.f.seek(*a)

        def read(self, *a):
            got = self.f.read(*a)
            read[0] += len(got)
            return got

    def counted_open(self, mode="r", *a, **k):
        f = real_open(self, mode, *a, **k)
        return Counted(f) if self == path and "r" in mode else f
    monkeypatch.setattr(pathlib.Path, "open", counted_open)

    def append_later():
        for piece in (data[cut:-3], data[-3:]):  # the exit record's chunk cut in two
            for _ in range(2):  # the waiter looks twice at each state of the file
                looked.acquire(timeout=30)
            with real_open(path, "ab") as f:
                f.write(piece)
    writer = threading.Thread(target=append_later)
    writer.start()
    assert wait_until_finished(tmp_path, timeout=60)
    writer.join()
    assert read[0] < 1.2 * len(data)  # re-parsing the whole file at each look reads it >= 5 times
    assert [r.WhichOneof("record_type") for r in records(path)] == ["run"] + ["history"] * 120 + ["exit"]


def test_a_run_file_without_its_exit_record_is_reported_in_one_line(tmp_path, caplog):
    """A timeout is not silent: the run's result is whole, but `wandb sync` may upload less of it."""
    import logging

    from wandb.proto import wandb_internal_pb2 as pb

    from normlab.wandb_files import wait_until_finished

    run = pb.Record()
    run.run.run_group = "study-x"
    path = tmp_path / "run-abc.wandb"
    path.write_bytes(leveldb_log([run]))
    with caplog.at_level(logging.WARNING, logger="normlab"):
        assert not wait_until_finished(tmp_path, timeout=0.1)
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line == (f"W&B offline run file {path} has no exit record after 0.1 s: `wandb sync` may miss "
                    "its last records")
