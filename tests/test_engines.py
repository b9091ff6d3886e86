"""The same run under every engine a user grows into (issue 37 item 11): train.py with the same
overrides as 2 CPU processes (gloo) under Lightning's own DDP launcher, under torchrun, and under
hydra/launcher=submitit_local with 2 tasks (the code path of hydra/launcher=slurm, in local
processes) is one run: the same folder name, results.json, metrics.csv and checkpoint tensors, bit
for bit. A run stopped under one engine continues under another from its folder and ends equal to
the uninterrupted run. Each engine runs in a working folder of its own, where the run's folder is
outputs/<run name> (a submitit multirun is pointed there by hydra.sweep.dir=outputs)."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.integration  # every test trains through the entry point

STEPS = 6
# results.json values that say where and how long, not what was trained: the rest must be equal.
# group: a sweep job's W&B group is its sweep folder's name (run_identity._group)
WHERE_AND_WHEN = {"run_dir", "checkpoint", "wall_s", "cpu_s", "train_tokens_per_s", "code", "code_legs", "group"}
TIMING_COLUMNS = {"train/tokens_per_s"}


def overrides(corpus: dict, cache: Path, *extra: str) -> list[str]:
    """test_ddp_train.py's smallest DDP run (LayerDrop and DropHead draw on every rank), logging the
    training loss at every step."""
    return [f"data.{k}={v}" for k, v in corpus.items()] + [
        "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
        "data.vocab_size=300", "data.max_tokens=512", f"data.cache_dir={cache}", "model.d_model=32",
        "model.encoder_ffn=64", "model.decoder_ffn=64", "model.encoder_layers=1", "model.decoder_layers=1",
        "regularizer=layerdrop_drophead", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=3",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "logger=csv",
        "eval.decoder.max_len_b=5", "eval.test_decoder.max_len_b=5", *extra]


def train(engine: str, cwd: Path, args: list[str], status: str = "completed") -> Path:
    """train.py with `args` under `engine` in `cwd`; the run's folder (outputs/<run name>), checked to
    hold `status`."""
    train_py = str(ROOT / "train.py")
    command = {"lightning": [sys.executable, train_py, *args],
               "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            train_py, *args],
               "submitit": [sys.executable, train_py, "-m", *args, "hydra/launcher=submitit_local",
                            "hydra.launcher.timeout_min=10",  # 2 tasks: tasks_per_node follows trainer.devices
                            "hydra.sweep.dir=outputs"]}[engine]
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread a rank under every engine (torchrun's default)
    p = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{engine}: {p.stderr[-3000:]}"
    (run_dir,) = [d for d in (cwd / "outputs").iterdir() if d.is_dir() and not d.name.startswith(".")]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == status and results["name"] == run_dir.name, (engine, results.get("status"))
    return run_dir


@pytest.fixture(scope="module")
def lightning_ddp(small_corpus, tmp_path_factory):
    """The reference: Lightning's own launcher (rank 0 starts rank 1 as a copy of the command)."""
    root = tmp_path_factory.mktemp("engines")
    return root, train("lightning", root / "lightning", overrides(small_corpus, root / "cache"))


def tensors(obj, key: str = ""):
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{key}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{key}/{i}")


def checkpoint_tensors(path: Path, run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint by its place in it (a run folder's path in a key made relative)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {key.replace(str(run_dir), "<run>"): t for key, t in tensors(state)}


def results(run_dir: Path) -> dict:
    out = json.loads((run_dir / "results.json").read_text())
    out["best"] = str(Path(out["checkpoint"]).relative_to(run_dir))
    return {k: v for k, v in out.items() if k not in WHERE_AND_WHEN}


def history(run_dir: Path) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in csv.DictReader(f)]


def assert_same_run(ref: Path, run_dir: Path, note: str) -> None:
    assert run_dir.name == ref.name, note  # one run name, so one folder under outputs/
    assert results(run_dir) == results(ref), note
    rows = history(ref)
    assert sum(bool(r.get("train/loss")) for r in rows) == STEPS, "the reference logs no training loss"
    assert history(run_dir) == rows, note
    names = sorted(p.name for p in (ref / "checkpoints").glob("*.ckpt"))
    assert names == ["best-step3.ckpt", f"full-step{STEPS}.ckpt", "last.ckpt"], names
    for name in names:
        a, b = checkpoint_tensors(ref / "checkpoints" / name, ref), checkpoint_tensors(
            run_dir / "checkpoints" / name, run_dir)
        assert sorted(a) == sorted(b), f"{note}: {name}: {sorted(set(a) ^ set(b))[:3]}"
        differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
        assert not differ, f"{note}: {name}: differ in {differ[:3]}"


def test_lightning_ddp_runs_two_ranks_in_one_folder(lightning_ddp):
    _, ref = lightning_ddp
    assert (ref / "train_ddp_process_1.log").is_file()  # rank 1, started by Lightning, logs beside rank 0
    assert "GLOBAL_RANK: 1" not in (ref / "train.log").read_text()


def test_torchrun_is_the_same_run(lightning_ddp, small_corpus):
    """torchrun starts both ranks; each runs the Hydra app and finds the same folder, rank 1 writes no
    record and logs to the file Lightning gives its rank 1."""
    root, ref = lightning_ddp
    run_dir = train("torchrun", root / "torchrun", overrides(small_corpus, root / "cache"))
    assert_same_run(ref, run_dir, "torchrun")
    assert "GLOBAL_RANK: 1" in (run_dir / "train_ddp_process_1.log").read_text()
    assert "GLOBAL_RANK: 1" not in (run_dir / "train.log").read_text()


def test_submitit_local_with_two_tasks_is_the_same_run(lightning_ddp, small_corpus):
    """Two tasks of one submitit job are the run's two ranks (torch's variables from submitit's):
    one 2-process DDP job, not two runs each starting ranks of its own."""
    root, ref = lightning_ddp
    run_dir = train("submitit", root / "submitit", overrides(small_corpus, root / "cache"))
    assert_same_run(ref, run_dir, "submitit_local, 2 tasks")
    assert len(list((root / "submitit" / "outputs" / ".submitit").glob("*/*_1_log.out"))) == 1  # task 1 ran
    assert "GLOBAL_RANK: 1" in (run_dir / "train_ddp_process_1.log").read_text()


@pytest.mark.slow  # make test: each engine's run equal to Lightning's (above) and a paused run continued exactly under one engine (test_runs_survive.py); make test-slow runs the cross-engine leg
def test_a_run_stopped_under_torchrun_continues_under_submitit(lightning_ddp, small_corpus):
    """Paused after step 4 under torchrun (a full checkpoint after the validation at step 3), the
    same overrides under submitit continue it in its folder: equal to the uninterrupted run, the
    best checkpoint's bookkeeping and the stall guard's token counts of both ranks included."""
    root, ref = lightning_ddp
    cwd, args = root / "continued", overrides(small_corpus, root / "cache")
    first = train("torchrun", cwd, [*args, "callbacks.preemption.stop_at_step=4"], status="stopped")
    assert json.loads((first / "results.json").read_text())["steps"] == 4
    run_dir = train("submitit", cwd, args)
    assert run_dir == first
    assert_same_run(ref, run_dir, "torchrun to step 4, then submitit")
    legs = json.loads((run_dir / "results.json").read_text())["code_legs"]
    assert [leg["from_step"] for leg in legs] == [0, 4]
