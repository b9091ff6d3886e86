"""status "stalled": the input-independent floor by value, the criterion on curves, and a real run
made to stall (no learning: lr ~ 0) next to one that learns; the report shows it like "diverged"."""
import csv
import json

import pytest
import torch

from normlab.callbacks.stall import input_independent_loss, is_stalled, own_counts
from normlab.commands import report
from normlab.commands.report_runs import find_runs
from normlab.losses import label_smoothed_nll
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

PAD = 0


@pytest.mark.parametrize("convention", ["uniform", "fairseq"])
def test_floor_is_the_loss_of_the_best_constant_prediction(convention):
    g = torch.Generator().manual_seed(0)
    V, eps = 11, 0.1
    targets = torch.multinomial(torch.tensor([0.0] + [2.0 ** -k for k in range(V - 1)]), 4000, True, generator=g)
    counts = torch.bincount(targets, minlength=V)
    floor = input_independent_loss(counts, eps, convention)

    def constant_loss(q):  # a model that predicts q whatever its input
        logits = q.log().expand(len(targets), V)[None]
        return label_smoothed_nll(logits, targets[None], eps, pad_id=-1, convention=convention)[0].item() / len(targets)

    p = counts.double() / counts.sum()
    tbar = (1 - eps) * p + (eps / V if convention == "uniform" else eps * (1 - p) / (V - 1))
    assert constant_loss(tbar.float()) == pytest.approx(floor, rel=1e-5)
    for other in (p * 0.98 + 0.02 / V, torch.full((V,), 1.0 / V), tbar.roll(1)):
        assert constant_loss(other.float()) > floor  # t̄ is the best constant prediction


def test_criterion_on_curves():
    floor, kw = 6.5, dict(window=10, patience=20, margin=0.25, min_delta=0.05)
    flat_high = [6.6 + 0.01 * (-1) ** i for i in range(40)]
    assert "flat at 6.6" in is_stalled(flat_high, floor, **kw)
    rising = [6.60] * 20 + [6.63] * 20  # up 0.03: the change is printed with its sign
    assert "flat at 6.630 (+0.030 in 20 steps)" in is_stalled(rising, floor, **kw)
    easing = [6.63] * 20 + [6.61] * 20
    assert "(-0.020 in 20 steps)" in is_stalled(easing, floor, **kw)
    falling = [8.0 - 0.05 * i for i in range(40)]  # above the floor but still learning
    assert is_stalled(falling, floor, **kw) is None
    converged = [5.7] * 40  # flat, far below the floor: a converged peer
    assert is_stalled(converged, floor, **kw) is None
    assert is_stalled(flat_high[:29], floor, **kw) is None  # too few steps to decide


STALL = ["callbacks.stall.window=4", "callbacks.stall.patience=8", "callbacks.stall.after_step=0",
         "trainer.max_steps=16", "eval.valid_bleu=false", "eval.test=false"]


@pytest.fixture(scope="module")
def two_runs(small_corpus, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "cache"
    out = {}
    for name, lr in (("stalled", "1e-12"), ("learning", "3e-3")):
        run_dir = tmp_path_factory.mktemp(name)
        out[name] = (run_dir, run(compose_cfg(tiny_overrides(small_corpus, run_dir, cache) + STALL
                                              + [f"optim.lr={lr}", "optim.warmup=1"])))
    return out


def test_a_run_that_learns_nothing_is_recorded_as_stalled(two_runs):
    run_dir, results = two_runs["stalled"]
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["status"] == results["status"] == "stalled"
    assert saved["stall_loss"] > saved["input_independent_loss"] - 0.25
    assert "flat" in saved["stall_reason"] and saved["steps"] == 16
    assert saved["valid_loss"] is not None  # scored like a completed run
    learned_dir, learned = two_runs["learning"]
    assert learned["status"] == "completed" and "stall_reason" not in learned


def test_report_shows_stalled_like_diverged(two_runs):
    runs = find_runs([str(two_runs["stalled"][0]), str(two_runs["learning"][0])])
    assert sorted(r.status for r in runs) == ["completed", "stalled"]
    table = report.build_table(runs, ["status"], ["seed"], "valid_loss")
    stalled = [c for (rv, _), c in table["cells"].items() if rv == ("stalled",)][0]
    assert stalled["text"] == "stalled 1/1" and stalled["mean"] is None
    both = report.cell_stats(runs, "valid_loss")
    assert both["text"].endswith("(1/2 stalled)") and both["completed"] == 1
    md = report.render_markdown(table, runs, [], {}, [], [])
    assert "| stalled | train loss flat at" in md.replace(str(two_runs["stalled"][0]), "")


@pytest.mark.integration
def test_stop_after_ends_a_stalled_run_early_and_spares_one_that_learns(small_corpus, tmp_path):
    """callbacks.stall.stop_after: checked every `window` steps; a run that learns nothing stops
    stop_after steps after the stall is first found (status stalled, both steps recorded); a run
    that learns trains to the end. (margin -0.5: "stalled" = flat above floor + 0.5, since a 2-layer
    d-32 model on 600 pairs is still near the floor after 60 steps of learning.)"""
    early = STALL[:3] + ["trainer.max_steps=60", "eval.test_decoder.beam=2",
                         "eval.test_decoder.max_len_b=5", "eval.decoder.max_len_b=5",
                         "callbacks.stall.stop_after=8", "callbacks.stall.margin=-0.5"]
    out = {}
    for name, lr in (("stalled", "1e-12"), ("learning", "3e-3")):
        run_dir = tmp_path / name
        out[name] = run(compose_cfg(tiny_overrides(small_corpus, run_dir, tmp_path / "cache") + early
                                    + [f"optim.lr={lr}", "optim.warmup=1"]))
    stalled = out["stalled"]
    # first check with a full window + patience (12 losses after step 0) at step 12, then 16, 20
    assert stalled["status"] == "stalled" and stalled["stall_detected_step"] == 12
    assert stalled["stopped_at_step"] == 20 and stalled["steps"] == 20 < 60
    # scored by the loss of its valid and test passes: a model at the floor is not decoded
    # (minutes to the length cap for a BLEU of 0; issue 21)
    assert stalled["valid_loss"] > 0 and stalled["valid_ppl"] > 1
    assert stalled["valid_bleu"] is None and stalled["valid_chrf"] is None
    assert stalled["test_loss"] > 0 and stalled["test_ppl"] > 1
    assert stalled["test_bleu"] is None and stalled["test_chrf"] is None
    assert "test_bleu_greedy" not in stalled and "test_bleu_avg" not in stalled
    assert not (tmp_path / "stalled" / "test.hyp").exists()
    # the validations before the stall was found decode; those while it is held (found at the check
    # of step 12, before that step's validation) score the loss only
    rows = [r for r in csv.DictReader(open(tmp_path / "stalled" / "csv" / "metrics.csv")) if r.get("valid/loss")]
    assert [int(r["step"]) + 1 for r in rows] == [4, 8, 12, 16, 20]  # the CSV counts steps from 0
    assert [bool(r.get("valid/bleu")) for r in rows] == [True, True, False, False, False]
    # the best is a decoded validation's (a loss-only one ranks last), and the final passes used it
    assert stalled["checkpoint"].endswith(("best-step4.ckpt", "best-step8.ckpt"))
    assert out["learning"]["status"] == "completed" and out["learning"]["steps"] == 60
    assert out["learning"]["valid_bleu"] is not None and out["learning"]["test_bleu_greedy"] is not None
    learned = [r for r in csv.DictReader(open(tmp_path / "learning" / "csv" / "metrics.csv")) if r.get("valid/loss")]
    assert learned and all(r.get("valid/bleu") for r in learned)  # a run that learns decodes every validation


def test_a_stall_that_recovers_clears_the_detection():
    from types import SimpleNamespace

    from normlab.callbacks.stall import StallGuard

    guard = StallGuard(window=2, patience=2, margin=0.25, min_delta=0.05, stop_after=4)
    decisions = iter([{"stall_reason": "flat", "stall_loss": 6.6, "input_independent_loss": 6.5}, None,
                      {"stall_reason": "flat", "stall_loss": 6.6, "input_independent_loss": 6.5}])
    guard._decide = lambda trainer, module: next(decisions)
    trainer, module = SimpleNamespace(global_step=0, should_stop=False), SimpleNamespace(decode_valid=True)
    module.hold_stall = lambda held: setattr(module, "decode_valid", not held)  # Seq2SeqModule's
    guard.losses.extend(torch.tensor(6.6) for _ in range(4))
    for step in (2, 4, 6):
        guard._start_step, trainer.global_step = step - 1, step  # an optimizer step ended in this batch
        guard.on_train_batch_end(trainer, module, torch.tensor(6.6), None, 0)
        assert guard.detected == {2: 2, 4: None, 6: 6}[step]  # found, cleared by a falling curve, found again
        assert module.decode_valid is (guard.detected is None)  # validation decodes again once cleared
    assert not trainer.should_stop and guard.outcome.running


@pytest.mark.integration
def test_a_stall_stop_at_the_first_validation_completes_as_stalled(small_corpus, tmp_path):
    """The validation Lightning runs at the stall stop is the run's first (interval 20, stop at 20,
    as deep_bleu's post-LN seed 2: found at 300, stopped at 500 = its first validation). It scores
    the loss only, and the best checkpoint, which watches valid/bleu, takes it as the worst score
    (Lightning raises when a monitored metric is missing: this failed the run before)."""
    over = tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + STALL[:3] + [
        "trainer.max_steps=60", "trainer.val_check_interval=20", "eval.test_decoder.beam=2",
        "eval.test_decoder.max_len_b=5", "eval.decoder.max_len_b=5", "callbacks.stall.stop_after=8",
        "callbacks.stall.margin=-0.5", "optim.lr=1e-12", "optim.warmup=1"]
    res = run(compose_cfg(over))
    assert res["status"] == "stalled" and res["stopped_at_step"] == 20
    assert res["valid_bleu"] is None and res["test_bleu"] is None and res["test_loss"] > 0
    assert res["checkpoint"].endswith("best-step20.ckpt")
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")) if r.get("valid/loss")]
    assert len(rows) == 1 and not rows[0].get("valid/bleu")  # its one validation decoded nothing


def test_a_stall_held_at_the_last_check_but_not_at_the_end_decodes_again():
    """Training can end between checks while a stall is held (max_steps not a multiple of the window):
    when the end decides no stall, the run completed and its final valid pass must decode (review)."""
    from types import SimpleNamespace

    from normlab.callbacks.stall import StallGuard

    guard = StallGuard(window=2, patience=2, stop_after=100)
    module = SimpleNamespace(decode_valid=False)
    module.hold_stall = lambda held: setattr(module, "decode_valid", not held)  # Seq2SeqModule's
    guard.detected, guard.counts = 10, torch.zeros(4)
    guard._decide = lambda trainer, m: None  # the end's check: no stall
    guard.on_train_end(SimpleNamespace(), module)
    assert guard.detected is None and module.decode_valid is True and guard.outcome.running


def test_the_optuna_objective_of_a_stalled_run_is_zero_bleu():
    from normlab.run_result import objective

    assert objective({"status": "stalled", "valid_bleu": None}) == 0.0
    assert objective({"status": "stalled", "valid_bleu": 0.1}) == 0.1  # a record decoded before the rule
    assert objective({"status": "completed", "valid_bleu": 21.5}) == 21.5
    assert objective({"status": "diverged", "valid_bleu": None}) is None  # a failed trial


def test_a_continued_ddp_run_takes_back_each_ranks_token_counts():
    """L* sums the target counts over ranks; a checkpoint keeps every rank's (the callback state is
    rank 0's), so a continued DDP run sums what the uninterrupted one sums (its input_independent_loss
    was of rank 0's counts twice: tests/test_engines.py compares the whole results.json)."""
    c0, c1 = torch.tensor([1, 2, 0]), torch.tensor([0, 5, 7])
    state = {"counts": c0, "counts_by_rank": [c0, c1]}
    assert torch.equal(own_counts(state, 0, 2), c0) and torch.equal(own_counts(state, 1, 2), c1)
    # resumed on another number of ranks (resume= under other trainer.devices): the sum on rank 0
    assert torch.equal(own_counts(state, 0, 1), c0 + c1)
    assert torch.equal(own_counts(state, 0, 3), c0 + c1) and own_counts(state, 2, 3) is None
    assert torch.equal(own_counts({"counts": c0}, 1, 2), c0)  # a checkpoint from before: rank 0's, as then


def test_a_one_process_checkpoint_resumed_on_two_ranks_counts_its_tokens_once():
    """A checkpoint of one process kept `counts` alone, so each of 2 ranks that resumed it took them: L*
    counted the first leg twice (review). Its counts are saved by rank too, and rank 0 alone takes them."""
    from types import SimpleNamespace

    from normlab.callbacks.stall import StallGuard

    guard = StallGuard()
    guard.counts = torch.tensor([3, 0, 4])
    ckpt = {"callbacks": {guard.state_key: guard.state_dict()}}
    guard.on_save_checkpoint(SimpleNamespace(world_size=1), None, ckpt)
    state = ckpt["callbacks"][guard.state_key]
    assert torch.equal(own_counts(state, 0, 2), guard.counts) and own_counts(state, 1, 2) is None
    assert torch.equal(own_counts(state, 0, 1), guard.counts)  # the same process count: its own
