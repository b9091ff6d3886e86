"""Lightning callbacks. Each is a `_target_` node under `callbacks` in the composed config
(conf/callbacks/*.yaml, composed by Hydra defaults: callbacks/default.yaml lists the run's
callbacks, init=admin adds Admin's), and `instantiate_callbacks` builds every such node, as
lightning-hydra-template's `instantiate_callbacks` does; nothing is wired by hand.
"""
from __future__ import annotations

from typing import Any


def instantiate_callbacks(callbacks_cfg: Any) -> list:
    """Every DictConfig node with a `_target_` under `callbacks`, in config order. A ConfigError
    raised by a callback's constructor (a bad value, naming its key) is re-raised as itself."""
    import hydra
    from hydra.errors import InstantiationException
    from omegaconf import DictConfig

    from normlab.config import ConfigError

    out = []
    for node in (callbacks_cfg or {}).values():
        if isinstance(node, DictConfig) and "_target_" in node:
            try:
                callback = hydra.utils.instantiate(node)
                if callback is not None:  # a factory may decline (the progress bar when the bar is off)
                    out.append(callback)
            except InstantiationException as e:
                if isinstance(e.__cause__, ConfigError):
                    raise e.__cause__ from None
                raise
    return out
