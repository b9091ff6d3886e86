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
    """Every DictConfig node with a `_target_` under `callbacks`, in config order. A key the
    callback does not take, or a ConfigError raised by its constructor (a bad value, naming its
    key), is one ConfigError, without Hydra's `Error in call to target` wrapper."""
    import hydra
    from hydra.errors import InstantiationException
    from omegaconf import DictConfig

    from normlab.config import ConfigError

    out = []
    for name, node in (callbacks_cfg or {}).items():
        if isinstance(node, DictConfig) and "_target_" in node:
            params = _parameters(node._target_)
            _check_keys(f"callbacks.{name}", node, params)
            try:
                takes = outcome is not None and params is not None and "outcome" in params
                callback = hydra.utils.instantiate(node, **({"outcome": outcome} if takes else {}))
                if callback is not None:  # a factory may decline (the progress bar when the bar is off)
                    out.append(callback)
            except InstantiationException as e:
                if isinstance(e.__cause__, ConfigError):
                    raise e.__cause__ from None
                raise
    return out


def _parameters(target: str) -> dict | None:
    """The constructor's parameters, None when they are unknown (a bad _target_: instantiate says
    what is wrong with it)."""
    import inspect

    import hydra

    try:
        return dict(inspect.signature(hydra.utils.get_object(target)).parameters)
    except Exception:
        return None


def _check_keys(key: str, node: Any, params: dict | None) -> None:
    """A key the constructor does not take (a typo, `+callbacks.stall.bogus=1`) names itself."""
    import inspect

    from normlab.config import check

    if params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    allowed = [p for p in params if p not in ("self", "outcome")]
    unknown = sorted(str(k) for k in node if not str(k).startswith("_") and k not in allowed)
    check(not unknown, f"{key}.{unknown[0] if unknown else ''}", "not an option of this callback", allowed)
