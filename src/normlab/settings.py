"""The optimizer and evaluation settings of a run as typed values, each default in one place.

The composed config's `optim` (conf/optim/*.yaml) and `eval` (conf/config.yaml) become an OptimSpec
and an EvalSpec once (run_spec.resolve); the LightningModule gets both at construction, and a
callback that needs one (the stall guard's label smoothing, DropHead's warmup) gets it in its
constructor (callbacks.instantiate_callbacks). A key the YAML sets wins; a key it leaves out takes
the default below; a key these classes do not have is refused, naming it. Adding a setting: its
YAML line and one field here (and its check in `validate`).
"""
from __future__ import annotations

import dataclasses
import math
import inspect
from dataclasses import dataclass
from typing import Any, Mapping

from normlab.config import check, check_bool, check_choice, check_number, is_num
from normlab import optimizers
from normlab.evaluation import make_decoder
from normlab.losses import CONVENTIONS as LABEL_SMOOTHING_CONVENTIONS
from normlab.lr_schedule import SCHEDULES as LR_SCHEDULES

# A decoder's settings are evaluation.make_decoder's arguments (its defaults: greedy, Vaswani et al.'s
# alpha 0.6, at most |src| + 50 tokens): the function owns the list and the defaults.
DECODER_KEYS = tuple(inspect.signature(make_decoder).parameters)


def _of(cls, group: str, values: Mapping[str, Any] | None):
    """`cls` from a config node's plain values; a key `cls` has no field for names itself."""
    values = dict(values or {})
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in values if k not in allowed)
    check(not unknown, f"{group}.{unknown[0] if unknown else ''}", f"not an {group} option", allowed)
    return cls(**values)


@dataclass(frozen=True)
class OptimSpec:
    """Adam (or AdamW by parameter groups: optimizers.py) with linear warmup, then the LR schedule; the
    defaults are Vaswani et al. 2017, 5.3-5.4."""
    lr: float | None = None          # the peak, at step == warmup; None: scale * d_model^-0.5 * warmup^-0.5
    scale: float = 1.0               # read only when lr is None
    schedule: str = "inverse_sqrt"   # lr_schedule.SCHEDULES
    warmup: int = 4000
    betas: Any = (0.9, 0.98)         # as given (a YAML list), two numbers
    eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 0.0           # max gradient norm (the Trainer's gradient_clip_val); 0: no clipping
    label_smoothing: float = 0.1
    label_smoothing_convention: str = "uniform"  # losses.CONVENTIONS
    tokens_per_update: int | None = None  # target tokens per optimizer step (budget.py); None: none
    z_loss: float = 0.0              # coefficient of z·log²Z added to the training objective (PaLM); 0: none
    optimizer: str = "adam"          # optimizers.OPTIMIZERS: adam (coupled L2 on every parameter) | adamw | muon
    no_decay: Any = optimizers.EXEMPTABLE  # adamw's (and muon's AdamW part's) undecayed groups; adam ignores it
    skip_spikes: float | None = None  # k: skip an update whose gradient norm > k x the window's median (spikes.py)
    spike_window: int = 100          # N: the window of the last N norms; read with skip_spikes alone

    @classmethod
    def of(cls, values: Mapping[str, Any] | None) -> "OptimSpec":
        return _of(cls, "optim", values)

    def validate(self) -> "OptimSpec":
        """Raises ConfigError naming the key (`optim.lr`) and what it allows."""
        check_number("optim.lr", self.lr, "a number > 0, or null for the paper's scale", lambda v: v > 0, null=True)
        check_number("optim.scale", self.scale, "a number > 0", lambda v: v > 0)
        check_number("optim.warmup", self.warmup, "an integer >= 0", lambda v: v >= 0, integer=True)
        check_number("optim.label_smoothing", self.label_smoothing, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0)
        check_choice("optim.label_smoothing_convention", self.label_smoothing_convention, LABEL_SMOOTHING_CONVENTIONS)
        check_choice("optim.schedule", self.schedule, LR_SCHEDULES)
        check_number("optim.clip_norm", self.clip_norm, "a number >= 0 (0: no clipping)", lambda v: v >= 0)
        check_number("optim.eps", self.eps, "a number > 0", lambda v: v > 0)
        check_number("optim.weight_decay", self.weight_decay, "a number >= 0", lambda v: v >= 0)
        check_choice("optim.optimizer", self.optimizer, optimizers.OPTIMIZERS)
        check_number("optim.z_loss", self.z_loss, "a number >= 0 (0: no z-loss; PaLM's 1e-4)", lambda v: v >= 0)
        groups = list(self.no_decay) if isinstance(self.no_decay, (list, tuple)) else None
        # each once and in one order, so that one set of groups is one run name
        check(groups is not None and groups == [g for g in optimizers.EXEMPTABLE if g in groups], "optim.no_decay",
              f"{self.no_decay!r} is not a list of parameter groups, each once, in the order "
              f"{', '.join(optimizers.EXEMPTABLE)}", f"a list of {', '.join(optimizers.EXEMPTABLE)} (the matrices "
              "are always decayed)")
        # a value nothing reads would still rename the run (as norm.mix_ratio away from `mix`): refused
        check(self.optimizer in ("adamw", "muon") or sorted(groups) == sorted(optimizers.EXEMPTABLE), "optim.no_decay",
              f"{list(groups)!r} with optim.optimizer={self.optimizer}: only adamw and muon (its AdamW part) read it",
              "optim=adamw or optim=muon, or leave optim.no_decay at its default")
        check_number("optim.skip_spikes", self.skip_spikes, "a number > 1 (k x the median norm), or null: never skip",
                     lambda v: 1 < v < math.inf, null=True)  # inf would never skip, yet rename the run
        check_number("optim.spike_window", self.spike_window, "an integer >= 1", lambda v: v >= 1, integer=True)
        check(self.skip_spikes is not None or self.spike_window == OptimSpec.spike_window, "optim.spike_window",
              f"{self.spike_window} with optim.skip_spikes=null: only the spike rule reads it",
              "optim.skip_spikes=K, or leave optim.spike_window at its default")
        b = self.betas
        betas = list(b) if hasattr(b, "__len__") and not isinstance(b, str) else [b]
        check(len(betas) == 2 and all(is_num(x) and 0 <= x < 1 for x in betas), "optim.betas",
              f"{b!r} is not valid", "two numbers in [0, 1), e.g. [0.9,0.98]")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain values: what a checkpoint's hyper_parameters hold (a checkpoint is loaded weights-only,
        so it holds no class of ours)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EvalSpec:
    """How validation and the final passes score (final_test.py; run_spec.FinalPasses)."""
    valid_bleu: bool = True          # decode the valid set at each validation (else its loss only)
    valid_subset: int | None = None  # validation's BLEU on this many valid sentences (evaluation.subset_rows)
    test: bool = True                # score the test split at the end
    decoder: dict | None = None      # validation's make_decoder arguments; None: its defaults (greedy)
    test_decoder: dict | None = None  # the final test's; None: as `decoder`
    test_greedy: bool = True         # also test with `decoder` when test_decoder differs (test_bleu_greedy)
    test_average: bool = True        # also test the average of the last step checkpoints (test_bleu_avg)

    @classmethod
    def of(cls, values: Mapping[str, Any] | None) -> "EvalSpec":
        return _of(cls, "eval", values)

    @property
    def valid_decoding(self) -> dict[str, Any]:
        return dict(self.decoder or {})

    @property
    def test_decoding(self) -> dict[str, Any]:
        return dict(self.test_decoder or self.valid_decoding)

    def validate(self) -> "EvalSpec":
        """Raises ConfigError naming the key (`eval.decoder.beam`) and what it allows."""
        for key in ("valid_bleu", "test", "test_greedy", "test_average"):
            check_bool(f"eval.{key}", getattr(self, key))
        check_number("eval.valid_subset", self.valid_subset, "an integer number of valid sentences > 0, or null "
                     "for all", lambda v: v > 0, integer=True, null=True)
        for name in ("decoder", "test_decoder"):
            _validate_decoder(f"eval.{name}", getattr(self, name) or {})
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _validate_decoder(key: str, d: Mapping[str, Any]) -> None:
    """The keys a decoder node sets (make_decoder's defaults are valid)."""
    check(isinstance(d, Mapping), key, f"{d!r} is not valid", f"a node of {', '.join(DECODER_KEYS)}")
    unknown = sorted(str(k) for k in d if k not in DECODER_KEYS)
    check(not unknown, f"{key}.{unknown[0] if unknown else ''}", "not a decoder option", DECODER_KEYS)
    rules = (("beam", "an integer > 0", lambda v: v > 0, True), ("lenpen", "a number (GNMT alpha; 0: none)", None, False),
             ("max_len_a", "a number >= 0", lambda v: v >= 0, False),
             ("max_len_b", "an integer >= 0", lambda v: v >= 0, True), ("min_len", "an integer >= 0", lambda v: v >= 0, True))
    for name, allowed, ok, integer in rules:
        if name in d:
            check_number(f"{key}.{name}", d[name], allowed, ok or (lambda v: True), integer=integer)
