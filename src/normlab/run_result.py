"""What a run returns: one RunResult, built once when the run ends (train.py), whose record is
results.json, the W&B summary (loggers.finish_loggers) and the value a Hydra sweeper optimises
(`objective`, returned by commands.train.task): three serialisations of one object, not a dict
that several steps update.

Its parts say where each value comes from: the status and the reasons from the run's RunOutcome
(outcome.py), the scores from the final passes (final_test.py), the counters from the Trainer and
the module, the provenance from the RunSpec and this machine. The record is those parts as one flat
object, the keys results.json has always had; a finished run's record read back (`from_record`)
is a RunResult again, part for part. A RunResult is also a read-only Mapping of its record, so
`result["test_bleu"]` reads as results.json does.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

from normlab.outcome import REASON_KEYS, Status

# What ran, where, with which code (the rest of the record's keys: outcome.REASON_KEYS, COUNTER_KEYS,
# and the scores: everything else, the final passes' keys being many and growing)
PROVENANCE_KEYS = ("run_dir", "name", "group", "seed", "identity_hash", "choices", "labels", "device", "cpu",
                   "code", "code_legs")
COUNTER_KEYS = ("steps", "planned_steps", "params", "train_tokens_per_s", "wall_s", "cpu_s", "compile_s",
                "skipped_updates", "skipped_steps")


@dataclass(frozen=True, eq=False)
class RunResult(Mapping):
    status: Status
    reasons: dict[str, Any] = field(default_factory=dict)  # why it ended so (outcome.REASON_KEYS): stopped_by,
    # diverged_step, stall_reason, input_independent_loss, error, ...
    scores: dict[str, Any] = field(default_factory=dict)  # the final passes' (valid_bleu, test_bleu, decoders,
    # checkpoint, partial, ...) and where the curve ended (plateau)
    counters: dict[str, Any] = field(default_factory=dict)  # COUNTER_KEYS: steps, params, throughput, time
    provenance: dict[str, Any] = field(default_factory=dict)  # PROVENANCE_KEYS

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "RunResult":
        """A results.json record as its parts (the inverse of `record`)."""
        part = lambda keys: {k: v for k, v in record.items() if k in keys}  # noqa: E731
        known = {"status", *REASON_KEYS, *COUNTER_KEYS, *PROVENANCE_KEYS}
        return cls(status=Status(record["status"]), reasons=part(REASON_KEYS), counters=part(COUNTER_KEYS),
                   provenance=part(PROVENANCE_KEYS), scores={k: v for k, v in record.items() if k not in known})

    @property
    def record(self) -> dict[str, Any]:
        """results.json: every part's keys in one object, the status as its string."""
        return {**self.provenance, **self.counters, **self.reasons, **self.scores, "status": self.status.value}

    def summary(self) -> dict[str, Any]:
        """The W&B run summary: the record, a score under its logged series' key (loggers.wandb_summary)."""
        from normlab.loggers import wandb_summary

        return wandb_summary(self.record)

    def objective(self) -> float | None:
        return objective(self)

    # the record, read-only
    def __getitem__(self, key: str) -> Any:
        return self.record[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.record)

    def __len__(self) -> int:
        return len(self.record)

    def __or__(self, other: Mapping) -> dict[str, Any]:  # `result | {...}`: a plain dict, as dict | dict
        return {**self.record, **other}


def objective(result: Mapping[str, Any]) -> float | None:
    """The value an Optuna sweeper maximises: valid BLEU (None: a failed trial). A stalled run is scored
    by its loss only (final_test.py): 0.0, the BLEU a model at its input-independent floor decodes to
    (every stalled study record that was decoded: 0.0), so TPE learns that its settings fail rather
    than leaving the trial out as failed."""
    if result.get("status") == Status.STALLED and result.get("valid_bleu") is None:
        return 0.0
    return result.get("valid_bleu")
