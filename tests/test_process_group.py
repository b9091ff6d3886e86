"""normlab.process_group: which launcher started this process as a rank of a run (torchrun, a task of
submitit's local executor, SLURM), its process count checked against trainer.devices x num_nodes in
one line, a submitit task given torch's variables, a rank above 0's log file its own. The engines
themselves, end to end: tests/test_engines.py."""
import logging

import pytest
from omegaconf import OmegaConf

from normlab import process_group as pg
from normlab.commands.train import main as train_main
from normlab.config import ConfigError
from normlab.run_folder import rank_zero

LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_LOCAL_JOB_ID", "SUBMITIT_LOCAL_NTASKS", "SUBMITIT_LOCAL_GLOBALID",
               "SUBMITIT_LOCAL_LOCALID", "SUBMITIT_LOCAL_NODEID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_JOB_NAME",
               "SLURM_JOB_ID")


@pytest.fixture
def env():
    """A process no launcher started; `env(**values)` sets the launcher's variables. Everything join()
    sets in the process (torch's variables, OMP_NUM_THREADS and torch's threads) is put back after."""
    import os

    import torch

    keys = (*LAUNCH_VARS, "OMP_NUM_THREADS")
    saved, threads = {k: os.environ.get(k) for k in keys}, torch.get_num_threads()
    for key in LAUNCH_VARS:
        os.environ.pop(key, None)

    def set_vars(**values):
        os.environ.update({key: str(value) for key, value in values.items()})
    yield set_vars
    for key, value in saved.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    torch.set_num_threads(threads)


def submitit_task(env, rank: int, job: str = "4242", tasks: int = 2) -> None:
    env(SUBMITIT_LOCAL_JOB_ID=job, SUBMITIT_LOCAL_NTASKS=tasks, SUBMITIT_LOCAL_GLOBALID=rank,
        SUBMITIT_LOCAL_LOCALID=rank, SUBMITIT_LOCAL_NODEID=0)


def test_each_launcher_is_found_with_its_process_count_and_rank(env):
    assert pg.launched() is None
    env(LOCAL_RANK=1)  # a rank Lightning's own launcher started: Lightning knows its processes
    assert pg.launched() is None
    env(TORCHELASTIC_RUN_ID="abc", WORLD_SIZE=4, RANK=3)
    assert (pg.launched().by, pg.launched().processes, pg.launched().rank) == ("torchrun", 4, 3)


def test_a_submitit_task(env):
    submitit_task(env, rank=1, tasks=3)
    found = pg.launched()
    assert (found.by, found.processes, found.rank, found.submitit_local) == ("submitit", 3, 1, True)


def test_slurm_tasks_but_not_an_interactive_allocation(env):
    env(SLURM_NTASKS=8, SLURM_PROCID=5, SLURM_JOB_NAME="bash")  # srun --pty bash: Lightning ignores SLURM
    assert pg.launched() is None
    env(SLURM_JOB_NAME="train")
    found = pg.launched()
    assert (found.by, found.processes, found.rank) == ("SLURM", 8, 5)


@pytest.mark.parametrize("trainer, processes", [({"devices": 2, "num_nodes": 1}, 2), ({"devices": 4, "num_nodes": 2}, 8),
                                                ({"devices": "3"}, 3), ({"devices": [0, 1]}, 2),
                                                ({"devices": "auto"}, None), ({"devices": -1}, None)])
def test_the_run_asks_for_one_process_a_device(trainer, processes):
    assert pg.run_processes(OmegaConf.create(trainer)) == processes


def test_another_process_count_than_the_run_is_one_line(env):
    env(TORCHELASTIC_RUN_ID="abc", WORLD_SIZE=2, RANK=0)
    pg.check(OmegaConf.create({"devices": 2, "num_nodes": 1}))  # agrees: nothing to say
    pg.check(OmegaConf.create({"devices": "auto"}))  # Lightning decides
    with pytest.raises(ConfigError) as e:
        pg.check(OmegaConf.create({"devices": 1, "num_nodes": 1}))
    assert str(e.value) == ("trainer.devices: the run is 1 process(es) (trainer.devices x trainer.num_nodes, one a "
                            "device), but torchrun started 2 (allowed: --nproc_per_node x --nnodes = 1, "
                            "trainer.devices x trainer.num_nodes = 2)")


def test_a_submitit_task_becomes_one_rank_of_one_job(env):
    """Both tasks of a job get one address and port, their own rank: torch's env:// rendezvous, and
    Lightning takes each as one rank started outside it; run_folder.rank_zero reads it."""
    import os

    seen = []
    for rank in (0, 1):
        submitit_task(env, rank)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        pg.join(None)
        seen.append({k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
        assert rank_zero() is (rank == 0)
    assert [s["RANK"] for s in seen] == [s["LOCAL_RANK"] for s in seen] == ["0", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {"2"} and len({(s["MASTER_ADDR"], s["MASTER_PORT"]) for s in seen}) == 1
    submitit_task(env, 0, job="4243")  # another job: another port (drawn from the job id)
    assert pg.export_torch_variables()["MASTER_PORT"] != seen[0]["MASTER_PORT"]


def test_a_single_task_job_is_left_to_lightning(env):
    import os

    submitit_task(env, 0, tasks=1)
    pg.join(None)
    assert "RANK" not in os.environ and "LOCAL_RANK" not in os.environ


def job_log(path, monkeypatch, met_rank_0: bool):
    """Hydra's job log handler (<job>.log, opened at its first line) on the root logger, taken off
    again (with whatever join() put in its place) by the caller's `finally`; torch.distributed's
    rendezvous faked as done or not."""
    monkeypatch.setattr(pg, "rendezvous_done", lambda: met_rank_0, raising=False)
    before = list(logging.getLogger().handlers)
    logging.getLogger().addHandler(logging.FileHandler(path, delay=True))
    return before


def restore(before):
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
        handler.close()


@pytest.mark.parametrize("rank, written", [(0, "train.log"), (1, "train_ddp_process_1.log")])
def test_a_rank_above_0_logs_to_a_file_of_its_own(env, tmp_path, monkeypatch, rank, written):
    """Rank 1's lines go where Lightning's own launcher puts its rank 1's, not into rank 0's file."""
    before = job_log(tmp_path / "train.log", monkeypatch, met_rank_0=True)
    try:
        env(TORCHELASTIC_RUN_ID="abc", WORLD_SIZE=2, RANK=rank)
        pg.join("train")
        logging.getLogger("normlab").warning("a line of rank %d", rank)
    finally:
        restore(before)
    assert [p.name for p in tmp_path.iterdir()] == [written]
    assert f"a line of rank {rank}" in (tmp_path / written).read_text()


def torchrun_rank_1(run, env, monkeypatch):
    """Rank 1 of a torchrun job joined into `run`, its rendezvous with rank 0 faked: append to `met` to
    meet rank 0. Returns (met, the logging state to restore)."""
    met = []
    before = job_log(run / "train.log", monkeypatch, met_rank_0=False)
    monkeypatch.setattr(pg, "rendezvous_done", lambda: bool(met), raising=False)
    env(TORCHELASTIC_RUN_ID="abc", WORLD_SIZE=2, RANK=1, LOCAL_RANK=1)
    pg.join("train")
    return met, before


def test_a_rank_above_0_writes_its_log_only_after_meeting_rank_0(env, tmp_path, monkeypatch):
    """torchrun starts both ranks of a second copy of a running run at once; only rank 0 takes the
    folder's lock and is refused. Its rank 1 used to append its start-up lines to the running run's
    train_ddp_process_1.log (issue 37): it now keeps them until the rendezvous with its rank 0 (which
    a refused rank 0 never enters), and then writes them, in order, before its next line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_ddp_process_1.log").write_text("[step 6] the running run's rank 1\n")
    met, before = torchrun_rank_1(run, env, monkeypatch)
    try:
        logging.getLogger("normlab").warning("start-up line 1")
        logging.getLogger("normlab").warning("start-up line 2")
        assert (run / "train_ddp_process_1.log").read_text() == "[step 6] the running run's rank 1\n"
        met.append(True)  # a run whose rank 0 holds the folder: the rendezvous is done
        logging.getLogger("normlab").warning("after the rendezvous")
    finally:
        restore(before)
    lines = (run / "train_ddp_process_1.log").read_text().splitlines()
    assert [line.rsplit(" ", 3)[-3:] for line in lines[1:]] == [["start-up", "line", "1"], ["start-up", "line", "2"],
                                                                ["after", "the", "rendezvous"]]
    assert sorted(p.name for p in run.iterdir()) == ["train_ddp_process_1.log"]


def test_a_rank_above_0_that_met_rank_0_keeps_every_line_to_its_end(env, tmp_path, monkeypatch):
    """Met rank 0 and logged nothing more before it ended: the kept lines are written when the log
    closes; a line after the process group is gone (at exit) is written too."""
    run = tmp_path / "run"
    run.mkdir()
    met, before = torchrun_rank_1(run, env, monkeypatch)
    try:
        logging.getLogger("normlab").warning("start-up line")
        met.append(True)
        logging.getLogger("normlab").warning("met")
        logging.getLogger("normlab").warning("kept until the end")  # written at once: met
        met.clear()  # the process group destroyed at exit
        logging.getLogger("normlab").warning("after the group")
        last = [h for h in logging.getLogger().handlers if isinstance(h, pg.AfterRendezvous)]
        assert last and not last[0].waiting  # nothing held back once met
    finally:
        restore(before)
    lines = (run / "train_ddp_process_1.log").read_text().splitlines()
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["start-up line".split()[-1], "met", "end", "group"]


def test_a_rank_above_0_that_never_meets_rank_0_leaves_the_folder_as_it_was(env, tmp_path, monkeypatch):
    """The refused copy's rank 1 ends (its rendezvous times out, or it is stopped) with its lines unwritten."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_ddp_process_1.log").write_text("the running run's line\n")
    before = job_log(run / "train.log", monkeypatch, met_rank_0=False)
    try:
        env(TORCHELASTIC_RUN_ID="abc", WORLD_SIZE=2, RANK=1, LOCAL_RANK=1)
        pg.join("train")
        logging.getLogger("normlab").warning("a refused copy's start-up line")
    finally:
        restore(before)  # closes the handlers, as logging.shutdown does at exit
    assert {p.name: p.read_text() for p in run.iterdir()} == {"train_ddp_process_1.log": "the running run's line\n"}


@pytest.mark.integration
def test_torchrun_with_another_process_count_is_one_line_and_no_folder(env, tmp_path, monkeypatch, capsys):
    """The job of rank 0 of `torchrun --nproc_per_node=2 train.py trainer.devices=1` (the rest of the
    output, torchrun's own report of the failed ranks, is torchrun's)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("NORMLAB_TRACEBACK", raising=False)
    env(TORCHELASTIC_RUN_ID="abc", WORLD_SIZE=2, RANK=0, LOCAL_RANK=0)
    assert train_main(["trainer=ddp", "trainer.devices=1", "logger=csv"]) == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert lines == ["error: trainer.devices: the run is 1 process(es) (trainer.devices x trainer.num_nodes, one a "
                     "device), but torchrun started 2 (allowed: --nproc_per_node x --nnodes = 1, trainer.devices x "
                     "trainer.num_nodes = 2)"]
    assert list(tmp_path.iterdir()) == []


def test_a_submitit_task_takes_its_share_of_the_cpus(env, monkeypatch):
    """As Lightning's own launcher divides them among its ranks; OMP_NUM_THREADS, when set, decides."""
    import os

    import torch

    os.environ.pop("OMP_NUM_THREADS", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert pg.divide_threads(4) == 4 == torch.get_num_threads() and os.environ["OMP_NUM_THREADS"] == "4"
    env(OMP_NUM_THREADS=3)
    assert pg.divide_threads(4) == 3
    os.environ.pop("OMP_NUM_THREADS")
    assert pg.divide_threads(32) == 1


@pytest.mark.integration
def test_srun_on_the_path_adds_no_line_to_a_refusal(env, tmp_path, monkeypatch, capsys):
    """A login node has `srun` without a SLURM allocation: Lightning's SLURMEnvironment.detect() warns there,
    a line before every refusal (review); the launcher is found without calling it."""
    import os

    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert train_main(["model.d_model=abc", "logger=csv", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model.d_model: "), lines


@pytest.mark.parametrize("nodes", ["two", 0, True])
def test_a_bad_num_nodes_is_left_to_validation(env, nodes):
    """run_processes read int(num_nodes) before the config was validated: `trainer.num_nodes=two` was a
    traceback and a failed record instead of validation's one line (review)."""
    assert pg.run_processes(OmegaConf.create({"devices": 2, "num_nodes": nodes})) is None
    pg.check(OmegaConf.create({"devices": 2, "num_nodes": nodes}))  # one process: nothing counted


@pytest.mark.integration
def test_a_bad_num_nodes_through_train_py_is_one_line(env, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert train_main(["trainer.num_nodes=two", "logger=csv", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: trainer.num_nodes: "), lines
    assert not (tmp_path / "run" / "results.json").exists()
