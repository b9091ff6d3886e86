"""Defaults of the submitit launchers (hydra-submitit-launcher): `hydra/launcher=submitit_local`
and `submitit_slurm` start one task per device (`tasks_per_node: ${trainer.devices}`) and, under
SLURM, `trainer.num_nodes` nodes, so a DDP run needs no `hydra.launcher.tasks_per_node=N` beside
`trainer.devices=N` (process_group.py refuses a task count that is not the run's device count; an
explicit `hydra.launcher.tasks_per_node=` still wins, as any override does).

The plugin's configs keep their names and types: they are stored again in Hydra's ConfigStore under
the same group and name with these two defaults changed. A YAML file of the same name in conf/ would
not do: Hydra would find the file again when it names the plugin's config as a default, and it merges
a same-named file into the ConfigStore schema only with a deprecation warning (Hydra 1.1 "automatic
schema matching")."""
from __future__ import annotations

import dataclasses


def tasks(devices) -> int:
    """The task count of `trainer.devices` (the plugin types it an int): a count, or a list's length; 1 for
    `auto` / -1, whose count Lightning decides later (process_group then refuses a count that differs, in
    one line, where `${trainer.devices}` alone failed inside Hydra with a traceback)."""
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return devices
    if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        return max(len(devices), 1)
    if isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        return int(devices)
    return 1


def register_launcher_defaults() -> bool:
    """Store the submitit configs with tasks_per_node (and SLURM nodes) from the trainer; False when
    the plugin is not installed (then `hydra/launcher=submitit_*` is unknown to Hydra anyway)."""
    try:
        from hydra_plugins.hydra_submitit_launcher import config as plugin
    except ImportError:
        return False
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    # Hydra's plugin scan (once a process, at the first Plugins.instance()) executes the plugin's
    # config module again, which stores the plugin's own defaults: scan first, then store ours
    Plugins.instance()
    store = ConfigStore.instance()
    devices = "${nl.tasks:${trainer.devices}}"
    store.store(group="hydra/launcher", name="submitit_local", provider="submitit_launcher",
                node=dataclasses.replace(plugin.LocalQueueConf(), tasks_per_node=devices))
    store.store(group="hydra/launcher", name="submitit_slurm", provider="submitit_launcher",
                node=dataclasses.replace(plugin.SlurmQueueConf(), tasks_per_node=devices,
                                         nodes="${trainer.num_nodes}"))
    return True
