"""One status vocabulary (normlab/outcome.py), carried up by the run's RunOutcome: the callbacks that
can end a run report to the object train.run built, never to attributes of the LightningModule."""
import ast
import json
from pathlib import Path

import torch

from normlab import outcome
from normlab.callbacks import RunValues
from normlab.callbacks.divergence import DivergenceGuard
from normlab.callbacks.preemption import Preemption
from normlab.callbacks.stall import StallGuard
from normlab.outcome import RunOutcome, Status
from normlab.train import build_callbacks

from conftest import FakeModule, FakeTrainer, compose_cfg

SRC = Path(__file__).resolve().parents[1] / "src" / "normlab"


def test_status_is_its_value_everywhere():
    assert str(Status.STALLED) == f"{Status.STALLED}" == "stalled" and Status("diverged") is Status.DIVERGED
    assert json.dumps({"status": Status.FAILED}) == '{"status": "failed"}'
    assert {Status.COMPLETED: 1}["completed"] == 1  # a member and its value are one key
    assert Status.STALLED in outcome.SCORED and Status.PREEMPTED not in outcome.SCORED
    assert Status.STOPPED not in outcome.SCORED  # its invocation's time is up: the rerun scores it
    assert set(outcome.FINISHED) | set(outcome.UNFINISHED) | {"failed", "interrupted", "debug", "running"} == \
        {s.value for s in Status}


def test_the_runs_outcome_reaches_every_callback_that_can_end_a_run():
    run_outcome = RunOutcome()
    callbacks = build_callbacks(compose_cfg([]).callbacks, RunValues(outcome=run_outcome))
    enders = [c for c in callbacks if isinstance(c, (DivergenceGuard, StallGuard, Preemption))]
    assert {type(c) for c in enders} == {DivergenceGuard, StallGuard, Preemption}
    assert all(c.outcome is run_outcome for c in enders)
    # built on their own (tests, other tools), each has an outcome of its own
    assert DivergenceGuard().outcome is not DivergenceGuard().outcome


def test_a_divergence_ends_the_outcome_with_its_reasons_and_leaves_the_module_alone():
    guard, trainer, module = DivergenceGuard(factor=None, patience=1), FakeTrainer(), FakeModule()
    guard.on_train_batch_start(trainer, module, None, 0)
    trainer.global_step = 1
    guard.on_train_batch_end(trainer, module, {"loss": torch.tensor(float("nan")), "token_loss": torch.tensor(float("nan"))},
                             None, 0)
    assert guard.outcome.status is Status.DIVERGED and trainer.should_stop
    assert guard.outcome.reasons["diverged_step"] == 0 and "non-finite" in guard.outcome.reasons["divergence_reason"]
    assert vars(module) == {}  # nothing written on the LightningModule


def test_no_callback_writes_on_the_lightning_module():
    """Callbacks report through the outcome or the module's methods: an assignment to an attribute of
    `pl_module` (status, divergence, stall, private counters) is a message bus through the module."""
    bad = []
    for path in (SRC / "callbacks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "pl_module":
                        bad.append(f"{path.name}:{node.lineno}: pl_module.{el.attr}")
    assert not bad, bad
    # ... and nobody reads a status back from the module
    for path in SRC.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert 'getattr(module, "status"' not in text and 'getattr(pl_module, "status"' not in text, path


def test_the_docs_list_every_status_once():  # docs/runs-that-survive.md, "One status vocabulary"
    text = (SRC.parents[1] / "docs" / "runs-that-survive.md").read_text(encoding="utf-8")
    table = text.split("<!-- statuses:begin")[1].split("<!-- statuses:end -->")[0]
    listed = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[3:] if line.startswith("| `")]
    assert sorted(listed) == sorted(s.value for s in Status) and len(listed) == len(set(listed))
