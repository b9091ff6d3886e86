"""The optimizer and evaluation settings as typed values (normlab/settings.py, issue 37 item 2): the
YAML wins, a key it leaves out takes the dataclass's default, an unknown key is refused; the module
and the callbacks get them at construction, and what they compute with them is checked against the
formulas (Adam's groups, the label-smoothed loss, the input-independent floor L*)."""
import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from normlab.callbacks import RunValues
from normlab.callbacks.drophead_schedule import DropHeadSchedule
from normlab.callbacks.full_checkpoint import FullStateCheckpoint
from normlab.callbacks.preemption import Preemption
from normlab.callbacks.stall import StallGuard, own_start
from normlab.config import ConfigError, ModelConfig
from normlab.lit_module import Seq2SeqModule
from normlab.outcome import RunOutcome, Status
from normlab.run_config import optim_and_eval, validate_run_config
from normlab.run_spec import FinalPasses
from normlab.settings import EvalSpec, OptimSpec
from normlab.train import build_callbacks

from conftest import ROOT, compose_cfg

TINY = dict(vocab_size=40, d_model=16, encoder_ffn=32, decoder_ffn=32, encoder_layers=1, decoder_layers=1,
            encoder_heads=2, decoder_heads=2, max_positions=64)


def plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True)


def test_the_yaml_wins_and_a_key_it_leaves_out_takes_the_one_default():
    cfg = compose_cfg(["optim.lr=7e-4", "optim.warmup=33", "eval.valid_subset=9"])
    optim, ev = optim_and_eval(cfg)
    assert dataclasses.asdict(optim) == plain(cfg.optim) and dataclasses.asdict(ev) == plain(cfg.eval)
    assert (optim.lr, optim.warmup, ev.valid_subset) == (7e-4, 33, 9)
    dropped = ["scale", "schedule", "weight_decay", "label_smoothing_convention"]
    optim, ev = optim_and_eval(compose_cfg([f"~optim.{k}" for k in dropped] + ["~eval.test_greedy", "~eval.test_decoder"]))
    defaults = OptimSpec()
    assert all(getattr(optim, k) == getattr(defaults, k) for k in dropped)
    assert (optim.scale, optim.schedule, optim.weight_decay, optim.label_smoothing_convention) == \
        (1.0, "inverse_sqrt", 0.0, "uniform")  # the paper's (Vaswani et al. 2017) and torch's convention
    assert ev.test_greedy is True and ev.test_decoding == ev.valid_decoding  # no test decoder: validation's


def test_the_shipped_optimizer_file_keeps_the_papers_constants():
    """conf/optim/adam_inverse_sqrt.yaml departs from the defaults only in the CPU budget's lr and
    warmup: Adam's betas and eps, label smoothing 0.1 and the schedule are Vaswani et al.'s."""
    yaml = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "optim" / "adam_inverse_sqrt.yaml"))
    defaults = dataclasses.asdict(OptimSpec())
    differ = {k for k, v in defaults.items() if (list(v) if isinstance(v, tuple) else v) != yaml[k]}
    assert differ == {"lr", "warmup"}
    assert set(yaml) == {f.name for f in dataclasses.fields(OptimSpec)}  # one field per YAML key, no more


@pytest.mark.parametrize("override, key", [("+optim.momentum=0.9", "optim.momentum"),
                                           ("+eval.beam=4", "eval.beam")])
def test_a_key_the_settings_do_not_have_is_refused_by_name(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: not an {key.split('.')[0]} option \(allowed: "):
        validate_run_config(compose_cfg([override]))


def test_the_final_passes_decode_with_the_yamls_decoders():
    cfg = compose_cfg([])
    passes = FinalPasses.of(EvalSpec.of(plain(cfg.eval)), keep_last_n=5)
    assert passes.decoders == {"valid": plain(cfg.eval.decoder), "test": plain(cfg.eval.test_decoder)}
    assert (passes.test, passes.greedy, passes.average_last_n) == (True, True, 5)
    same = FinalPasses.of(EvalSpec(decoder={"beam": 1}, test_decoder=None, test_average=False), keep_last_n=5)
    assert same.decoders == {"valid": {"beam": 1}, "test": {"beam": 1}} and not same.greedy and same.average_last_n == 0


def test_adam_gets_the_optimizer_settings_and_a_checkpoint_holds_plain_values(tmp_path):
    optim = OptimSpec(lr=2e-3, warmup=4, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.01)
    module = Seq2SeqModule(ModelConfig(**TINY).to_dict(), optim=optim, eval=EvalSpec(valid_bleu=False))
    group = module.configure_optimizers()["optimizer"].param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.01)
    assert group["lr"] == pytest.approx(2e-3 * 1 / 4)  # step 1 of a 4-step linear warmup to the peak
    assert module.hparams["optim"] == dataclasses.asdict(optim) and module.hparams["eval"]["valid_bleu"] is False
    torch.save({"hyper_parameters": dict(module.hparams)}, tmp_path / "h.ckpt")  # loaded weights-only (checkpoint.py)
    assert torch.load(tmp_path / "h.ckpt", weights_only=True)["hyper_parameters"]["optim"]["eps"] == 1e-6


@pytest.mark.parametrize("eps, convention", [(0.0, "uniform"), (0.2, "uniform"), (0.2, "fairseq")])
def test_the_training_loss_smooths_as_the_settings_say(eps, convention):
    """loss = Σ over non-pad targets of -(1-ε)·log p_y - ε/V·Σ_v log p_v (uniform), or
    -(1-ε)·log p_y - ε/(V-1)·Σ_{v≠y} log p_v (fairseq), from the model's logits by hand."""
    torch.manual_seed(0)
    optim = OptimSpec(label_smoothing=eps, label_smoothing_convention=convention)
    module = Seq2SeqModule(ModelConfig(**TINY).to_dict(), optim=optim, eval=EvalSpec()).eval()
    src, tgt = torch.randint(3, 40, (2, 5)), torch.randint(3, 40, (2, 6))
    tgt[1, 4:] = 0  # padding
    loss, nll, ntok, _ = module._loss({"src": src, "tgt_in": tgt, "tgt_out": tgt})
    with torch.no_grad():
        lp = torch.log_softmax(module.model(src, tgt).double(), dim=-1)[tgt != 0]  # (N, V), non-pad rows
    y = tgt[tgt != 0]
    gold, total, V = lp.gather(1, y[:, None]).squeeze(1), lp.sum(-1), lp.shape[-1]
    by_hand = -((1 - eps) * gold + eps / V * total) if convention == "uniform" else \
        -((1 - eps) * gold + eps / (V - 1) * (total - gold))
    assert ntok == 10 and float(nll) == pytest.approx(float(-gold.sum()), rel=1e-5)
    assert float(loss) == pytest.approx(float(by_hand.sum()), rel=1e-5)


@pytest.mark.parametrize("convention", ["uniform", "fairseq"])
def test_the_stall_floor_is_of_the_runs_label_smoothing(convention):
    """L* = -Σ_v t̄_v log t̄_v with t̄ = (1-ε)p + ε/V (uniform) or (1-ε)p + ε(1-p)/(V-1) (fairseq), p the
    unigram distribution of the non-pad targets (callbacks/stall.py), computed here by hand."""
    guard = StallGuard(optim=OptimSpec(label_smoothing=0.3, label_smoothing_convention=convention))
    counts = [7, 0, 0, 5, 1, 2]  # id 0 is the padding: not a target
    guard.counts = torch.tensor(counts)
    floor = guard._floor(None, SimpleNamespace(model_cfg=SimpleNamespace(pad_id=0)), reduce=False)
    V, eps, n = len(counts), 0.3, sum(counts[1:])
    p = [0.0] + [c / n for c in counts[1:]]
    t = [(1 - eps) * q + (eps / V if convention == "uniform" else eps * (1 - q) / (V - 1)) for q in p]
    assert floor == pytest.approx(-sum(x * math.log(x) for x in t), rel=1e-12)


def test_each_callback_gets_the_runs_values_when_it_is_built():
    outcome, optim = RunOutcome(), OptimSpec(warmup=7, label_smoothing=0.2, label_smoothing_convention="fairseq")
    values = RunValues(outcome=outcome, optim=optim, started=123.0, code={"commit": "abc"}, max_time=60.0)
    built = {type(c): c for c in build_callbacks(compose_cfg([]).callbacks, values)}
    assert built[DropHeadSchedule].warmup == 7  # the node's warmup: null -> optim.warmup
    assert (built[StallGuard].smoothing, built[StallGuard].convention) == (0.2, "fairseq")
    assert built[StallGuard].outcome is outcome and built[Preemption].outcome is outcome
    assert (built[FullStateCheckpoint].started, built[FullStateCheckpoint].code) == (123.0, {"commit": "abc"})
    assert built[Preemption].max_time == 60.0
    own = {type(c): c for c in build_callbacks(compose_cfg(["callbacks.drophead_schedule.warmup=3"]).callbacks, values)}
    assert own[DropHeadSchedule].warmup == 3  # the node's own value wins
    alone = {type(c): c for c in build_callbacks(compose_cfg([]).callbacks)}  # no run: the defaults
    assert alone[DropHeadSchedule].warmup == OptimSpec().warmup and alone[Preemption].max_time is None


def test_a_run_value_is_not_a_callback_option():
    with pytest.raises(ConfigError, match=r"^callbacks\.preemption\.max_time: not an option of this callback"):
        build_callbacks(compose_cfg(["+callbacks.preemption.max_time=5"]).callbacks, RunValues(max_time=60.0))


def _held(tmp_path: Path, ckpt: Path | None) -> tuple[StallGuard, RunOutcome]:
    """A guard restored with a stall record (the run ended stalled there), started from `ckpt`."""
    guard = StallGuard()
    guard.load_state_dict({"ended": {"stall_loss": 6.6, "stall_reason": "flat"}, "detected": 5})
    trainer = SimpleNamespace(ckpt_path=None if ckpt is None else str(ckpt), default_root_dir=str(tmp_path / "run"),
                              should_stop=False)
    module = SimpleNamespace(decode_valid=True)
    module.hold_stall = lambda held: setattr(module, "decode_valid", not held)
    guard.on_train_start(trainer, module)
    return guard, trainer


def test_a_stall_carries_on_from_the_runs_own_checkpoint_only(tmp_path):
    """The run's own checkpoint (in its folder) carries its stall on: stalled again at once; resume=
    another run's does not: that run's stall is not this one's, and it trains on (was
    stall.carry_end, which train.run set after building the guard)."""
    own = tmp_path / "run" / "checkpoints" / "full-step20.ckpt"
    other = tmp_path / "other" / "checkpoints" / "full-step20.ckpt"
    assert own_start(SimpleNamespace(ckpt_path=None, default_root_dir=str(tmp_path / "run")))
    guard, trainer = _held(tmp_path, own)
    assert guard.outcome.status is Status.STALLED and trainer.should_stop and guard.ended is not None
    guard, trainer = _held(tmp_path, other)
    assert guard.outcome.running and not trainer.should_stop and guard.ended is None and guard.detected is None
