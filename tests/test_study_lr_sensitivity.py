"""LR sensitivity from an arm's screen (study/lr_sensitivity.py; Wortsman et al. 2023) against hand
computations, and the `lr_sensitivity` claim: held / contradicted / inconclusive by its margin, not
run without the screens, its spec checks and its rows in the claims table and the index."""
import json
import math

import pytest

from normlab.errors import UserError
from normlab.study.claims import judge
from normlab.study.fixed import definition
from normlab.study.lr_sensitivity import sensitivity
from normlab.study.records import load_records
from normlab.study.screen_outcome import load_screens
from normlab.study.spec import load_study
from normlab.study.verdict_text import claims_lines, index_row

from study_files import write_study_file

LRS = [0.001, 0.003, 0.01, 0.03]
CAP = 9.0  # a round ℓ0 for hand sums (a study's is ln V: 8.987 for 8,000 pieces)


def row(lr, values: dict, status="stopped", floor=6.5, warmup=None) -> dict:
    overrides = [f"optim.lr={lr!r}"] + ([f"optim.warmup={warmup}"] if warmup is not None else [])
    name = f"lr{lr!r}" + (f"-warmup{warmup}" if warmup is not None else "")
    return {"name": name, "overrides": overrides, "values": {str(k): v for k, v in values.items()}, "status": status,
            "dropped_at": None, "floor": floor}


def screen(rows, rungs=(1000,)) -> dict:
    return {"arm": "x", "by": "valid_loss", "rungs": list(rungs), "keep": 1.0, "seed": 1, "settings": rows,
            "chosen": rows[0]["name"]}


def at_last(losses: list, statuses=None) -> dict:
    """Every lr of LRS trained to the one rung 1000 (None: no value there)."""
    statuses = statuses or [None] * len(losses)
    return screen([row(lr, {1000: v}, status=st or ("stopped" if v is not None else "diverged"))
                   for lr, v, st in zip(LRS, losses, statuses)])


def test_sensitivity_is_the_mean_capped_loss_above_the_best_over_the_learning_rates():
    # 4.0, 3.6, 3.8, 4.4: ℓ* = 3.6; (0.4 + 0 + 0.2 + 0.8) / 4 = 0.35
    s = sensitivity(at_last([4.0, 3.6, 3.8, 4.4]), CAP)
    assert s["value"] == pytest.approx(0.35) and s["best"] == pytest.approx(3.6)
    assert s["losses"] == {0.001: 4.0, 0.003: 3.6, 0.01: 3.8, 0.03: 4.4} and s["dropped"] == [] and s["seed"] == 1
    # a diverged lr counts at the cap, a stalled one at its floor (6.5), a value above the cap at the cap:
    # ℓ* = 3.7; (0.3 + 0 + (9.0 - 3.7) + (6.5 - 3.7)) / 4 = 8.4 / 4 = 2.1
    s = sensitivity(at_last([4.0, 3.7, None, None], [None, None, "diverged", "stalled"]), CAP)
    assert s["value"] == pytest.approx(2.1) and s["losses"][0.01] == CAP and s["losses"][0.03] == 6.5
    s = sensitivity(at_last([4.0, 3.7, 9.5, float("nan")]), CAP)  # above ℓ0; a nan loss is a divergence
    assert s["losses"][0.01] == CAP and s["losses"][0.03] == CAP and s["value"] == pytest.approx((0.3 + 2 * 5.3) / 4)
    # the same losses under the cap ln 8000 (a study's ℓ0): only the capped terms move
    s = sensitivity(at_last([4.0, 3.7, None, 6.5], [None, None, "diverged", None]), math.log(8000))
    assert s["value"] == pytest.approx((0.3 + (math.log(8000) - 3.7) + 2.8) / 4)


def test_a_setting_dropped_at_an_early_rung_counts_at_its_last_value_and_is_named():
    rows = [row(0.001, {500: 4.6}), row(0.003, {500: 4.1, 1000: 3.6}), row(0.01, {500: 4.3})]
    s = sensitivity(screen(rows, rungs=(500, 1000)), CAP)
    assert s["losses"] == {0.001: 4.6, 0.003: 3.6, 0.01: 4.3} and s["dropped"] == [0.001, 0.01]
    assert s["value"] == pytest.approx((1.0 + 0 + 0.7) / 3)
    # a setting that diverged before the rung is not "dropped": its loss is the cap, not a bound
    rows[2] = row(0.01, {500: None}, status="diverged")
    assert sensitivity(screen(rows, rungs=(500, 1000)), CAP)["dropped"] == [0.001]


def test_other_grid_keys_take_the_best_setting_at_each_learning_rate():
    rows = [row(0.001, {1000: 4.2}, warmup=150), row(0.001, {1000: 4.0}, warmup=1000),
            row(0.01, {1000: None}, status="diverged", warmup=150), row(0.01, {1000: 3.5}, warmup=1000)]
    s = sensitivity(screen(rows), CAP)
    assert s["losses"] == {0.001: 4.0, 0.01: 3.5} and s["value"] == pytest.approx(0.25)


def test_no_sensitivity_without_a_complete_screen_or_a_setting_below_the_cap():
    assert sensitivity(None, CAP) is None
    running = at_last([4.0, 3.6, 3.8, 4.4])
    running["settings"][1]["status"] = None  # still training
    assert sensitivity(running, CAP) is None
    none_trained = sensitivity(at_last([None] * 4), CAP)
    assert none_trained["value"] is None and none_trained["best"] is None


CLAIM = {"id": "qk", "claim": "QK-norm lowers LR sensitivity", "source": "s", "paper": "p", "kind": "lr_sensitivity",
         "better": "a", "than": "b1", "margin": 0.2, "cap": CAP}
SCREEN = "screen:\n  grid: {optim.lr: [0.001, 0.003, 0.01, 0.03]}\n  rungs: [1000]\n  keep: 1.0\n"


def judged(tmp_path, a: list, b1: list, claims=(CLAIM,)):
    study = load_study(str(write_study_file(tmp_path, list(claims), extra=SCREEN)))
    out = tmp_path / "out"
    (out / "screen").mkdir(parents=True, exist_ok=True)
    for arm, losses in (("a", a), ("b1", b1)):
        if losses is not None:
            (out / "screen" / f"{arm}.json").write_text(json.dumps(at_last(losses)))
    return {v.claim.id: v for v in judge(study, load_records(out), None, load_screens(study, out))}


def test_the_claim_holds_by_the_margin_and_is_contradicted_by_it(tmp_path):
    stable, unstable = [4.0, 3.6, 3.8, 4.4], [4.0, 3.7, None, None]  # 0.35 and (0.3 + 5.3 + 5.3) / 4 = 2.725
    v = judged(tmp_path / "1", stable, unstable)["qk"]
    assert v.verdict == "held" and v.means == {"a": pytest.approx(0.35), "b1": pytest.approx(2.725)}
    assert "a 0.350 − b1 2.725 = -2.375 nats (margin 0.2; one screen each, no seed variance)" in v.note
    assert judged(tmp_path / "2", unstable, stable)["qk"].verdict == "contradicted"
    # 0.35 against 0.45 (4.8 at the largest lr): a difference of 0.1 < 0.2 decides nothing
    assert judged(tmp_path / "3", stable, [4.0, 3.6, 3.8, 4.8])["qk"].verdict == "inconclusive"
    # exactly the margin apart holds (<=): 0.4375 against 0.6875, margin 0.25 (sums exact in binary)
    exact = ({**CLAIM, "margin": 0.25},)
    assert judged(tmp_path / "4", [4.0, 3.5, 3.75, 4.5], [4.0, 3.5, 3.75, 5.5], exact)["qk"].verdict == "held"
    assert judged(tmp_path / "4b", [4.0, 3.5, 3.75, 5.5], [4.0, 3.5, 3.75, 4.5], exact)["qk"].verdict == "contradicted"
    # no screen of b1 yet: not run; b1 diverged everywhere: no sensitivity, no score
    v = judged(tmp_path / "5", stable, None)["qk"]
    assert v.verdict == "not run" and "no complete screen of b1" in v.note
    assert judged(tmp_path / "6", stable, [None] * 4)["qk"].verdict == "no score"


def test_the_claims_table_and_the_index_show_both_sensitivities(tmp_path):
    v = judged(tmp_path, [4.0, 3.6, 3.8, 4.4], [4.0, 3.7, None, None])["qk"]
    c = json.loads(json.dumps(v.as_dict()))  # as claims.json holds it (the lrs become strings)
    assert c["lr_sensitivity"]["a"]["losses"] == {"0.001": 4.0, "0.003": 3.6, "0.01": 3.8, "0.03": 4.4}
    row_ = next(line for line in claims_lines([c]) if line.startswith("| QK-norm"))
    assert row_ == ("| QK-norm lowers LR sensitivity (a vs b1, LR sensitivity) | s | p | a 0.350, b1 2.725 nats "
                    "(A − B -2.375) | — | **held** |")
    assert index_row("s", "s", c).endswith("| a 0.350, b1 2.725 nats (A − B -2.375) | one screen each (seed 1), "
                                           "margin 0.2 nats: no interval | **held** |")
    nothing = json.loads(json.dumps(judged(tmp_path / "n", [4.0, 3.6, 3.8, 4.4], None)["qk"].as_dict()))
    assert "| b1: no screen |" in next(line for line in claims_lines([nothing]) if line.startswith("| QK-norm"))


def test_margin_and_cap_are_part_of_the_fixed_definition(tmp_path):
    study = load_study(str(write_study_file(tmp_path, [CLAIM], extra=SCREEN)))
    d = definition(study.claims[0])
    assert d["margin"] == 0.2 and d["cap"] == CAP and d["kind"] == "lr_sensitivity"


@pytest.mark.parametrize("change, extra, key, words", [
    ({"margin": None}, SCREEN, "claims[0].margin", "missing"),
    ({"cap": None}, SCREEN, "claims[0].cap", "positive number"),
    ({"cap": -1}, SCREEN, "claims[0].cap", "positive number"),
    ({"than": "b_best"}, SCREEN, "claims[0]", "compares two arms' screens"),
    ({}, "", "claims[0]", "screen whose grid has optim.lr"),
    ({}, "screen:\n  grid: {optim.warmup: [150, 1000]}\n  rungs: [1000]\n", "claims[0]", "optim.lr"),
    ({"kind": "compare"}, SCREEN, "claims[0].cap", "only an lr_sensitivity claim has a cap"),
    ({}, SCREEN.rstrip("\n") + "\n  by: valid_bleu\n", "screen.by", "reads losses in nats"),  # BLEU read as a loss
    ({"metric": "test_bleu"}, SCREEN, "claims[0].metric", "test_bleu: an lr_sensitivity claim reads its arms' screens, "
     "ranked by screen.by (allowed: valid_loss)"),
])
def test_a_bad_lr_sensitivity_claim_is_one_line_naming_its_key(tmp_path, change, extra, key, words):
    c = {k: v for k, v in {**CLAIM, **change}.items() if v is not None}
    with pytest.raises(UserError) as e:
        load_study(str(write_study_file(tmp_path, [c], extra=extra)))
    assert key in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("by, given", [("valid_loss", None), ("valid_nll", None), ("valid_nll", "valid_nll")])
def test_claims_json_names_the_screens_metric_the_claim_reads(tmp_path, by, given):
    """An lr_sensitivity claim reads its screens' `by` (valid_loss or valid_nll), not the claims' default
    test_bleu: claims.json and its fixed definition say so; a compare claim beside it keeps its own metric."""
    from normlab.study.readme import _write_claims

    from study_files import claim

    qk = {**CLAIM, **({"metric": given} if given else {})}
    study = load_study(str(write_study_file(tmp_path, [qk, claim(id="plain")], extra=SCREEN + f"  by: {by}\n")))
    out = tmp_path / "out"
    (out / "screen").mkdir(parents=True)
    for arm in ("a", "b1"):
        (out / "screen" / f"{arm}.json").write_text(json.dumps({**at_last([4.0, 3.6, 3.8, 4.4]), "by": by}))
    verdicts = judge(study, load_records(out), None, load_screens(study, out))
    _write_claims(study, {}, verdicts, out, {})
    written = {c["id"]: c for c in json.loads((out / "claims.json").read_text())["claims"]}
    assert {k: c["metric"] for k, c in written.items()} == {"qk": by, "plain": "test_bleu"}
    assert written["qk"]["verdict"] == "inconclusive" and definition(study.claims[0])["metric"] == by


def test_an_unscreened_arm_cannot_carry_an_lr_sensitivity_claim(tmp_path):
    path = write_study_file(tmp_path, [CLAIM], extra=SCREEN)
    path.write_text(path.read_text().replace("b1: {overrides: [norm=postnorm, optim.lr=1e-3]}",
                                             "b1: {overrides: [norm=postnorm, optim.lr=1e-3], screen: false}"))
    with pytest.raises(UserError, match=r"arms\.b1\.screen.*reads its screen"):
        load_study(str(path))


def test_the_stability_studys_cap_is_ln_of_its_vocabulary():
    """conf/study/stability.yaml's ℓ0 is ln V of the vocabulary its runs compose (a change of corpus or
    vocabulary without its cap would judge on the wrong ceiling)."""
    from normlab.study.plan import compose

    study = load_study("stability")
    cfg = compose(study.arm_overrides(study.arms["pre_ln"], 1))
    caps = {c.cap for c in study.claims if c.kind == "lr_sensitivity"}
    assert len(caps) == 1 and caps.pop() == pytest.approx(math.log(cfg.data.vocab_size), abs=1e-12)
    assert study.screen.keep == 1.0 and len(study.screen.rungs) == 1  # every rate read at one step: no bound
