"""The scoring passes a study makes that none of its claims, table, picks or screen read (issue 36;
normlab.study.passes): listed per pass with the arms that make it, never turned off by the study code
(that would rename every run of a study that has records)."""
import dataclasses

import pytest

from normlab.study.passes import metrics_read, unread_passes
from normlab.study.spec import load_study

from study_files import claim, write_study_file

GREEDY, AVERAGED, VALID = "final test greedy", "final test averaged", "final valid decode"


def _study(tmp_path, claims=(), extra=""):
    return load_study(str(write_study_file(tmp_path, [claim(**c) for c in claims] or [claim()], extra=extra)))


def test_passes_no_claim_reads_are_listed_with_their_arms(tmp_path):
    # the defaults run the greedy and the averaged test; the claims read test_bleu, the pick valid_bleu
    study = _study(tmp_path)
    assert metrics_read(study) >= {"test_bleu", "valid_bleu"}
    assert unread_passes(study) == {GREEDY: ["a", "b1", "b2"], AVERAGED: ["a", "b1", "b2"]}


def test_a_pass_that_a_claim_or_the_table_reads_is_not_listed(tmp_path):
    study = _study(tmp_path / "c", [{"metric": "test_bleu_greedy"}], extra="table_metrics: [test_bleu, test_bleu_avg]\n")
    assert unread_passes(study) == {}
    # the table without valid_bleu or valid_chrf, and no pick by them: the final valid decode is unread
    study = _study(tmp_path / "t", extra="table_metrics: [test_bleu, valid_nll]\n"
                                         "common: [eval.test_greedy=false, eval.test_average=false]\n")
    study = dataclasses.replace(study, best_of={})
    assert unread_passes(study) == {VALID: ["a", "b1", "b2"]}


def test_passes_a_run_does_not_make_are_not_listed(tmp_path):
    # greedy only when the test decoder differs from validation's; averaging only with step checkpoints
    study = _study(tmp_path, extra="common: [eval.test_decoder.beam=1, callbacks.step_checkpoints.keep_last_n=0]\n")
    assert unread_passes(study) == {}
    study = _study(tmp_path / "off", extra="common: [eval.test=false]\n")
    assert unread_passes(study) == {}


PRUNE_STUDY = """title: t
paper: p
question: q
common: [model.encoder_layers=2, model.decoder_layers=2, eval.test_greedy=false, eval.test_average=false]
arms:
  ld: {overrides: [regularizer=layerdrop], prune: {depths: [1, 2], strategies: [every_other, data_driven]}}
  small: {overrides: [model.encoder_layers=1, model.decoder_layers=1]}
claims:
  - {id: c, claim: c, source: s, paper: p, better: ld, than: small, metric: prune.every_other.r1.test_bleu}
table_metrics: [test_bleu, valid_bleu]
"""


def test_the_prune_commands_unread_decodes_are_listed(tmp_path):
    """The prune command decodes valid and test for the unpruned model and every pruned one; here only
    every_other r1's test BLEU is read. data_driven needs learned rates (else its row has no scores)
    and r2 keeps every layer (no row)."""
    (tmp_path / "p.yaml").write_text(PRUNE_STUDY)
    assert unread_passes(load_study(str(tmp_path / "p.yaml"))) == {
        "prune full r2 valid decode": ["ld"], "prune full r2 test decode": ["ld"],
        "prune every_other r1 valid decode": ["ld"]}
    (tmp_path / "q.yaml").write_text(PRUNE_STUDY.replace("regularizer=layerdrop]", "regularizer=layerdrop, "
                                                         "regularizer.layerdrop_rates=learned]"))
    assert set(unread_passes(load_study(str(tmp_path / "q.yaml")))) == {
        "prune full r2 valid decode", "prune full r2 test decode", "prune every_other r1 valid decode",
        "prune data_driven r1 valid decode", "prune data_driven r1 test decode"}


# What the shipped studies score and never read (issue 36's list for the lead). Their common overrides
# already turn off the greedy and averaged tests; what is left cannot be turned off per pass today: the
# final valid decode goes only with eval.valid_bleu=false (the best checkpoint by loss, not BLEU), and
# the prune command decodes valid and test for every model it scores.
PRUNE_UNREAD = {"final valid decode": ["ld0", "ld0.2", "{learned}", "scratch3"],
                "prune full r6 valid decode": ["ld0", "ld0.2", "{learned}"],
                "prune full r6 test decode": ["ld0", "ld0.2", "{learned}"],
                "prune every_other r3 valid decode": ["ld0", "ld0.2", "{learned}"],
                "prune search_on_valid r3 valid decode": ["ld0", "ld0.2", "{learned}"],
                "prune data_driven r3 valid decode": ["{learned}"]}
SHIPPED = {"deep_bleu": {}, "stability": {}, "deep_bleu_2k": {}, "deep_recent": {}, "deep_recent_2k": {}, "drophead": {}, "drophead_4k": {},
           "output_change": {}, "stall_calibration": {},
           "twt_lowres": {}, "twt_lowres_2k": {}, "twt_scalenorm": {}, "twt_scalenorm_2k": {},
           "layerdrop_prune": {k: [a.format(learned="ld0.5_learned") for a in v] for k, v in PRUNE_UNREAD.items()},
           "layerdrop_prune_4k": {k: [a.format(learned="ld0.5_learned") for a in v] for k, v in PRUNE_UNREAD.items()},
           "layerdrop_prune_2k": {k: [a.format(learned="ld0.2_learned") for a in v] for k, v in PRUNE_UNREAD.items()}}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_shipped_studies_unread_passes(name):
    """A pass a shipped study starts to make without reading it fails here: read it, turn it off in
    the study's common overrides, or add it to this list knowingly."""
    assert unread_passes(load_study(name)) == SHIPPED[name]


def test_every_shipped_study_is_checked():
    from normlab.study.spec import available

    assert sorted(SHIPPED) == available()


def test_the_trains_bar_reads_the_references_valid_nll_and_test_bleu(tmp_path):
    """A trains claim measured against a reference arm reads valid NLL and test BLEU (claims.trains_bar)
    even where no claim or table names them."""
    trains = [{"kind": "trains", "metric": "valid_loss"}]
    plain = metrics_read(_study(tmp_path / "p", trains, extra="table_metrics: [valid_loss]\n"))
    assert "test_bleu" not in plain and "valid_nll" not in plain
    with_ref = metrics_read(_study(tmp_path / "r", trains, extra="table_metrics: [valid_loss]\nreference: a\n"))
    assert {"test_bleu", "valid_nll"} <= with_ref
