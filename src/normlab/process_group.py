"""The processes of one DDP run, whoever starts them (issue 37 item 11). The same train.py and
overrides run under each engine, in the same folder, with bitwise-equal results on CPU:

- Lightning's own launcher (`trainer=ddp trainer.devices=N`): rank 0 runs the command and starts
  ranks 1..N-1 as copies of it (`hydra.job.name=train_ddp_process_<r>`, LOCAL_RANK set).
- torchrun (`torchrun --standalone --nproc_per_node=N train.py ...`): every rank runs the Hydra app;
  Lightning takes the ranks from torch elastic's variables (TorchElasticEnvironment).
- SLURM (srun, `hydra/launcher=slurm`): every task runs the job; Lightning's SLURMEnvironment.
- submitit's local executor (`-m hydra/launcher=submitit_local hydra.launcher.tasks_per_node=N`):
  every task runs the job, and Lightning has no detection of it (it would start N ranks from each
  task, re-running submitit's worker module). Each task is given torch's env:// variables from
  submitit's (SUBMITIT_LOCAL_*), as submitit.helpers.TorchDistributedEnvironment does, and Lightning's
  default LightningEnvironment takes the process as one rank started outside it (LOCAL_RANK set);
  its threads are the machine's CPUs over the tasks, as Lightning's own launcher divides them.

Whichever started them, the launcher's process count must be the run's (trainer.devices x
trainer.num_nodes: one process per device), and ranks above 0 write nothing of the run's records:
rank 0 holds the folder and writes .hydra/, run.json, results.json and checkpoints (run_folder,
commands/train.py); a rank above 0 started outside Lightning logs to `<job>_ddp_process_<rank>.log`,
the file Lightning's launcher gives its own ranks, not into rank 0's `<job>.log`.
"""
from __future__ import annotations

import logging
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.config import ConfigError


@dataclass(frozen=True)
class Launched:
    """The processes a launcher started for one run: who (as the user typed it), how many, this one's rank."""
    by: str       # the launcher: torchrun, submitit, SLURM
    setting: str  # what sets its process count, as the user types it
    processes: int
    rank: int
    submitit_local: bool = False  # torch's variables still to be set from submitit's (join)


def launched() -> Launched | None:
    """The launcher that started this process as one of several of a run, else None (a single process:
    one device, or Lightning's own launcher, which starts the others itself)."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") is not None:  # torch.distributed.is_torchelastic_launched()
        return Launched("torchrun", "--nproc_per_node x --nnodes", int(env["WORLD_SIZE"]), int(env["RANK"]))
    if env.get("SUBMITIT_LOCAL_JOB_ID") is not None and "SUBMITIT_LOCAL_NTASKS" in env:
        return Launched("submitit", "hydra.launcher.tasks_per_node", int(env["SUBMITIT_LOCAL_NTASKS"]),
                        int(env.get("SUBMITIT_LOCAL_GLOBALID", "0")), submitit_local=True)
    # Lightning's SLURMEnvironment.detect() without its call: it warns (a line before any refusal) where
    # `srun` is on PATH but unused, e.g. a login node (review)
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):  # srun, launcher=slurm
        return Launched("SLURM", "--ntasks (hydra.launcher.tasks_per_node x nodes)", int(env["SLURM_NTASKS"]),
                        int(env.get("SLURM_PROCID", "0")))
    return None


def run_processes(trainer: Any) -> int | None:
    """The processes the run's trainer config asks for (devices x num_nodes); None where Lightning
    decides (devices auto or -1)."""
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    nodes = 1 if nodes is None else nodes
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:  # refused by validation, in one line
        return None
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices * nodes
    if not isinstance(devices, (str, int)) and hasattr(devices, "__len__"):  # a list of device ids
        return len(devices) * nodes
    return None


def join(job_name: str | None) -> None:
    """At the job's start, before any rank is read (run_folder.rank_zero): give a task of submitit's
    local executor torch's variables, and send a rank above 0's log lines to a file of its own."""
    found = launched()
    if found is None:
        return
    if found.submitit_local and found.processes > 1:
        export_torch_variables()
        divide_threads(found.processes)
    if found.rank > 0 and job_name:
        own_log_file(job_name, found.rank)


def check(trainer: Any) -> None:
    """The launcher's process count is the run's: one process a device (Lightning would stop with a
    traceback, or, under submitit, start its own ranks from each task)."""
    found = launched()
    if found is None:  # one process: nothing to count (and trainer.* not validated yet: a bad value is its line)
        return
    wanted = run_processes(trainer)
    if found is not None and wanted is not None and wanted != found.processes:
        raise ConfigError("trainer.devices", f"the run is {wanted} process(es) (trainer.devices x trainer.num_nodes, "
                                             f"one a device), but {found.by} started {found.processes}",
                          [f"{found.setting} = {wanted}", f"trainer.devices x trainer.num_nodes = {found.processes}"])


def export_torch_variables() -> dict[str, str]:
    """torch's env:// variables for a task of submitit's local executor, from submitit's: every task of
    the job gets the same address and port (the port drawn from the job id, as submitit's
    TorchDistributedEnvironment draws it; one machine, so the loopback address). Values already set
    are kept."""
    env = os.environ
    job, tasks = env["SUBMITIT_LOCAL_JOB_ID"], env["SUBMITIT_LOCAL_NTASKS"]
    values = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(random.Random(job).randint(20000, 60000)),
              "RANK": env.get("SUBMITIT_LOCAL_GLOBALID", "0"), "LOCAL_RANK": env.get("SUBMITIT_LOCAL_LOCALID", "0"),
              "WORLD_SIZE": tasks, "LOCAL_WORLD_SIZE": tasks, "NODE_RANK": env.get("SUBMITIT_LOCAL_NODEID", "0")}
    for key, value in values.items():
        env.setdefault(key, value)
    return values


def divide_threads(processes: int) -> int:
    """The threads of each of `processes` ranks on this machine, as Lightning's own launcher divides
    them (lightning.fabric.utilities.distributed._set_num_threads_if_needed): the CPUs this process
    may use over the processes, unless OMP_NUM_THREADS is set (torchrun sets 1). Without it each task
    of a submitit job took every core."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cpus // processes))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return int(os.environ["OMP_NUM_THREADS"])


def own_log_file(job_name: str, rank: int) -> None:
    """Move the job's log file handler (Hydra's `<job>.log`, opened at its first line) to
    `<job>_ddp_process_<rank>.log` beside it, written only once this rank has met rank 0 in
    torch.distributed's rendezvous (AfterRendezvous)."""
    root = logging.getLogger()
    for i, handler in enumerate(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).name == f"{job_name}.log":
            with handler.lock:
                if handler.stream is not None:  # opened by an earlier line: the next one opens the new file
                    handler.stream.close()
                    handler.stream = None
                handler.baseFilename = str(Path(handler.baseFilename).with_name(f"{job_name}_ddp_process_{rank}.log"))
            root.handlers[i] = AfterRendezvous(handler)


def rendezvous_done() -> bool:
    """Whether this process joined the run's default process group (torch.distributed initialised),
    read without importing torch."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


class AfterRendezvous(logging.Handler):
    """A rank above 0's log file, opened only after the rendezvous with rank 0; the lines before it are
    kept and written then. torchrun and SLURM start every rank at once, and only rank 0 takes the run
    folder's lock (run_folder.locked): the rank 1 of a second copy of a running run, refused on rank 0,
    used to append its start-up lines to the running run's `<job>_ddp_process_1.log` (issue 37). Rank
    0 enters the rendezvous only while holding the folder, so a rank that met it writes into its own
    run's folder; a rank that never meets it (its rank 0 refused) writes nothing there."""

    def __init__(self, target: logging.FileHandler):
        super().__init__(target.level)
        self.target, self.waiting, self.met = target, [], False
        self.setFormatter(target.formatter)
        for f in target.filters:
            self.addFilter(f)

    def emit(self, record: logging.LogRecord) -> None:
        # once met, always this run's: lines after the process group is destroyed (at exit) are written too
        self.met = self.met or rendezvous_done()
        if not self.met:
            self.waiting.append(record)
            return
        self._write_waiting()
        self.target.handle(record)

    def _write_waiting(self) -> None:
        for kept in self.waiting:
            self.target.handle(kept)
        self.waiting.clear()

    @property
    def baseFilename(self) -> str:  # noqa: N802  (logging.FileHandler's name: where the lines go)
        return self.target.baseFilename

    def flush(self) -> None:
        self.target.flush()

    def close(self) -> None:
        if self.met or rendezvous_done():  # met rank 0, then logged nothing more: its lines are this run's
            self._write_waiting()
        self.waiting.clear()  # never met rank 0: the lines were on the console, the folder is not this run's
        self.target.close()
        super().close()
