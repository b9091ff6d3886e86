"""The tokens-per-update warning advises a setting the run accepts and that reaches the target (issue
37 item 8: it advised a data.max_tokens below model.max_positions, which run_config refuses).

Tokens per update = data.max_tokens x devices x accumulation, the accumulation derived from
optim.tokens_per_update (budget.py); the warning comes when that product is off the target by more
than a factor 1.25."""
import logging
import re

import pytest

from normlab.budget import budget_notes
from normlab.run_config import validate_run_config

from conftest import compose_cfg


def _warnings(cfg) -> list[str]:
    notes = budget_notes(cfg.trainer, cfg.data.max_tokens, cfg.optim.tokens_per_update, cfg.model.max_positions)
    return [line for level, line in notes if level == logging.WARNING]


def _cfg(devices: int, max_tokens: int, target: int, max_positions: int = 256):
    return compose_cfg([f"trainer.devices={devices}", f"data.max_tokens={max_tokens}",
                        f"optim.tokens_per_update={target}", f"model.max_positions={max_positions}"])


@pytest.mark.parametrize("devices, max_tokens, target", [
    (1, 8192, 4096),   # one batch is twice the target
    (1, 3000, 4096),   # accumulation 1.37 rounds to 1: 0.73 of the target
    (1, 2048, 3072),   # 1.5 rounds to 2: 1.33 of it (the advice keeps the accumulation: smaller batches)
    (2, 2048, 6000),   # 1.46 rounds to 1 over two devices
    (8, 4096, 4096),   # eight devices: the target is 512 tokens a device
])
def test_the_advised_max_tokens_is_accepted_and_reaches_the_target(devices, max_tokens, target):
    (warning,) = _warnings(_cfg(devices, max_tokens, target))
    advised = int(re.fullmatch(r".*: set data\.max_tokens to about (\d+)", warning).group(1))
    cfg = _cfg(devices, advised, target)
    validate_run_config(cfg)  # a batch holds the longest pair: max_tokens >= model.max_positions
    assert _warnings(cfg) == []


def test_a_target_below_one_batch_per_device_says_what_reaches_it():
    """8 devices x 256 tokens (max_positions: the smallest batch a run accepts) is 2,048 tokens, more
    than a target of 1,024: no data.max_tokens reaches it (it advised 128)."""
    (warning,) = _warnings(_cfg(8, 2048, 1024))
    assert warning.endswith(": the smallest update here is data.max_tokens 256 (model.max_positions, the least a "
                            "batch holds) x 8 device(s) = 2048 tokens: set optim.tokens_per_update to at least "
                            "2048, or train on fewer devices"), warning
    for fix in (_cfg(8, 256, 2048), _cfg(4, 256, 1024)):  # the target it names; half the devices
        validate_run_config(fix)
        assert _warnings(fix) == []
