"""Multi-node launch configs compose, and a tiny job runs through submitit (the code path SLURM
array jobs take, in local subprocesses); rerunning the same multirun finds the finished run."""
import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from conftest import CONF, ROOT, tiny_overrides


def test_slurm_launcher_config_follows_the_trainer():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=8",
                                                       "trainer.num_nodes=2", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (2, 8, 8)  # one task per GPU
    assert launcher.signal_delay_s > 0 and launcher.max_num_timeout > 0 and launcher.partition == "gpu"


def launcher_config(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True).hydra.launcher


@pytest.mark.parametrize("name", ["submitit_local", "submitit_slurm"])
def test_submitit_launchers_start_one_task_per_device(name):
    """Without hydra.launcher.tasks_per_node the plugin's default (1 task) met a 2-device run, which
    process_group.py refuses (issue 37): the task count now follows trainer.devices unless given."""
    launcher = launcher_config(f"hydra/launcher={name}", "trainer=ddp", "trainer.devices=2", "trainer.num_nodes=3")
    assert launcher._target_.endswith("SlurmLauncher" if name == "submitit_slurm" else "LocalLauncher")
    assert launcher.tasks_per_node == 2
    assert launcher.nodes == (3 if name == "submitit_slurm" else 1)  # local: one machine, whatever the trainer says
    assert launcher_config(f"hydra/launcher={name}", "trainer=ddp", "trainer.devices=4").tasks_per_node == 4
    # a device list counts its devices; `auto` / -1 (Lightning decides later) start one task, where
    # ${trainer.devices} alone put 'auto' into the plugin's int field (a traceback inside Hydra)
    assert launcher_config(f"hydra/launcher={name}", "trainer.devices=[0,1,2]").tasks_per_node == 3
    for devices in ("auto", "-1"):
        assert launcher_config(f"hydra/launcher={name}", f"trainer.devices={devices}").tasks_per_node == 1
    # an explicit count still wins (process_group.py then refuses it if it is not the device count)
    assert launcher_config(f"hydra/launcher={name}", "trainer.devices=2",
                           "hydra.launcher.tasks_per_node=3").tasks_per_node == 3


def test_submitit_launchers_keep_the_plugins_other_defaults():
    """normlab changes two defaults of the plugin's configs, not their keys, types or other values."""
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
    from omegaconf import OmegaConf
    for name, conf in [("submitit_local", LocalQueueConf), ("submitit_slurm", SlurmQueueConf)]:
        ours = OmegaConf.to_container(launcher_config(f"hydra/launcher={name}", "hydra.sweep.dir=s",
                                                      "hydra.job.name=j"), resolve=True)
        plugin = OmegaConf.to_container(OmegaConf.structured(conf(submitit_folder="s/.submitit/%j", name="j")))
        changed = {k for k in plugin if ours[k] != plugin[k]}
        assert ours.keys() == plugin.keys() and changed <= {"tasks_per_node", "nodes"}
    with pytest.raises(Exception, match="tasks_per_node"):  # still typed: an int
        launcher_config("hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=two")


@pytest.mark.integration
@pytest.mark.slow  # make test: a multirun through submitit_local in test_engines.py (2 tasks) and test_run_lock.py (a refused job)
def test_a_tiny_multirun_through_submitit_local(small_corpus, tmp_path):
    args = [o for o in tiny_overrides(small_corpus, tmp_path / "unused", tmp_path / "cache")
            if not o.startswith("++run_dir")] + [
        "trainer.max_steps=2", "trainer.val_check_interval=2", "eval.test=false", "callbacks.step_checkpoints.keep_last_n=0",
        "seed=5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(*extra):
        return subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", *args, *extra], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
    p = train("hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10")
    assert p.returncode == 0, p.stderr[-3000:]
    [sweep] = (tmp_path / "multirun").iterdir()
    assert sweep.name.startswith("multirun-")  # <study>-<id of the sweep's definition>
    [job] = [d for d in sweep.iterdir() if (d / "results.json").is_file()]
    results = json.loads((job / "results.json").read_text())
    assert results["status"] == "completed" and results["steps"] == 2 and results["group"] == sweep.name
    assert job.name == results["name"] and list(sweep.glob(".submitit/*/*_log.out"))  # ran as a submitit job
    assert "seed=5" in (job / ".hydra" / "overrides.yaml").read_text()  # recorded by the job in its worker
    # the same multirun again (another launcher is not another sweep): nothing is retrained
    p = train()
    assert p.returncode == 0, p.stderr[-3000:]
    assert "already completed" in p.stdout
    assert [d.name for d in (tmp_path / "multirun").iterdir()] == [sweep.name]
