"""Lightning callbacks. Each is a `_target_` node under `callbacks` in the composed config
(conf/callbacks/*.yaml, composed by Hydra defaults: callbacks/default.yaml lists the run's
callbacks, init=admin adds Admin's), and `instantiate_callbacks` builds every such node, as
lightning-hydra-template's `instantiate_callbacks` does; nothing is wired by hand. The one object
passed in is the run's `RunOutcome` (normlab/outcome.py), to every callback whose constructor takes
`outcome`: the callbacks that can end a run report to it, not to the LightningModule.
"""
from __future__ import annotations

from typing import Any


def instantiate_callbacks(callbacks_cfg: Any, outcome: Any = None) -> list:
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
                takes = outcome is not None and _takes_outcome(node._target_)
                callback = hydra.utils.instantiate(node, **({"outcome": outcome} if takes else {}))
                if callback is not None:  # a factory may decline (the progress bar when the bar is off)
                    out.append(callback)
            except InstantiationException as e:
                if isinstance(e.__cause__, ConfigError):
                    raise e.__cause__ from None
                raise
    return out


def _takes_outcome(target: str) -> bool:
    import inspect

    import hydra

    try:
        return "outcome" in inspect.signature(hydra.utils.get_object(target)).parameters
    except Exception:  # a bad _target_: instantiate says what is wrong with it
        return False
