"""Lightning callbacks. Each is a `_target_` node under `callbacks` in the composed config
(conf/callbacks/*.yaml, composed by Hydra defaults: callbacks/default.yaml lists the run's
callbacks, init=admin adds Admin's), and `instantiate_callbacks` builds every such node, as
lightning-hydra-template's `instantiate_callbacks` does; nothing is wired by hand.

What a callback needs from the run rather than from its node (the run's `RunOutcome`, its
optimizer settings, its start time and code, its time cap) is a `RunValues` field: each is passed
to every callback whose constructor has a parameter of that name, when it is built; nothing is set
on a callback afterwards, and no callback looks the LightningModule's attributes up by name.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from normlab.outcome import RunOutcome
    from normlab.settings import OptimSpec


@dataclass(frozen=True)
class RunValues:
    """The run-derived values a callback's constructor may take, by parameter name (None: not given,
    the constructor's default applies). They are not options: a node that sets one is refused."""
    outcome: RunOutcome | None = None  # what the run ends as (outcome.py): the callbacks that end a run report to it
    optim: OptimSpec | None = None  # settings.OptimSpec: the stall guard's label smoothing, DropHead's warmup
    started: float | None = None  # time.time() at the run's start: wall time includes data loading
    code: dict | None = None  # this leg's code (provenance.code_version), on rank 0
    max_time: float | None = None  # trainer.max_time in seconds: preemption stops there, checkpointed

    def given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def instantiate_callbacks(callbacks_cfg: Any, values: RunValues | None = None) -> list:
    """Every DictConfig node with a `_target_` under `callbacks`, in config order, each given the
    `values` its constructor takes. A key the callback does not take, or a ConfigError raised by its
    constructor (a bad value, naming its key), is one ConfigError, without Hydra's `Error in call to
    target` wrapper."""
    import hydra
    from hydra.errors import InstantiationException
    from omegaconf import DictConfig

    from normlab.config import ConfigError

    given = (values or RunValues()).given()
    out = []
    for name, node in (callbacks_cfg or {}).items():
        if isinstance(node, DictConfig) and "_target_" in node:
            params = _parameters(node._target_)
            _check_keys(f"callbacks.{name}", node, params)
            try:  # the node's own values; the run's are passed as they are (instantiate would copy them)
                build = hydra.utils.instantiate(node, _partial_=True)
            except InstantiationException as e:
                if isinstance(e.__cause__, ConfigError):
                    raise e.__cause__ from None
                raise
            try:
                callback = build(**{k: v for k, v in given.items() if params is not None and k in params})
            except ConfigError:
                raise
            except Exception as e:  # as Hydra reports a constructor's error (a user error: one line)
                raise InstantiationException(f"Error in call to target '{node._target_}':\n{e!r}") from e
            if callback is not None:  # a factory may decline (the progress bar when the bar is off)
                out.append(callback)
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
    """A key the constructor does not take (a typo, `+callbacks.stall.bogus=1`) or one the run gives
    (`+callbacks.stall.optim=...`) names itself."""
    import inspect

    from normlab.config import check

    if params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    run_values = {f.name for f in fields(RunValues)}
    allowed = [p for p in params if p != "self" and p not in run_values]
    unknown = sorted(str(k) for k in node if not str(k).startswith("_") and k not in allowed)
    check(not unknown, f"{key}.{unknown[0] if unknown else ''}", "not an option of this callback", allowed)
