"""Claims fixed before their data (study/fixed.py, issue 35 item 5): the first records fix each
claim's definition; a later change is shown with the verdict it had and the reason, never silently;
one claim id is judged the same way in every study."""
import json
from dataclasses import replace

from normlab.study.fixed import (RULES, change_lines, definition, definition_hash, moved_lines, same_kind_across_studies,
                                 update_lock)
from normlab.study.spec import Claim, available, load_study

C = Claim(id="w", claim="no warmup costs < 1 BLEU", source="p", paper="x", better="a", than="b", kind="similar",
          margin=1.0)


def test_the_definition_is_what_decides_the_verdict_not_its_words():
    assert definition(C) == {"kind": "similar", "margin": 1.0, "better": "a", "than": "b", "metric": "test_bleu",
                             "than_metric": None, "direction": None}
    assert definition_hash(replace(C, claim="reworded", source="Table 4", paper="y")) == definition_hash(C)
    for change in ({"kind": "no_worse"}, {"margin": 0.5}, {"than": "c"}, {"metric": "valid_bleu"}, {"direction": "lower"}):
        assert definition_hash(replace(C, **change)) != definition_hash(C), change
    # a compare claim's margin is never read: changing it changes nothing
    assert definition_hash(replace(C, kind="compare", margin=3.0)) == definition_hash(replace(C, kind="compare"))


def test_a_study_without_records_may_change_its_claims_then_they_are_fixed(tmp_path):
    assert update_lock(tmp_path, [C], {"w": "not run"}, has_records=False, today="d0") == {}
    assert not (tmp_path / "claims.lock.json").exists()
    assert update_lock(tmp_path, [C], {"w": "inconclusive"}, has_records=True, today="d1") == {}
    lock = json.loads((tmp_path / "claims.lock.json").read_text())
    assert lock["w"]["fixed"]["kind"] == "similar" and lock["w"]["verdict"] == "inconclusive"
    # the kind changed after the data (twt_scalenorm's warmup claim did: similar -> no_worse)
    changed = replace(C, kind="no_worse", changed="one-sided: a gain is not a cost")
    ch = update_lock(tmp_path, [changed], {"w": "held"}, has_records=True, today="d2")["w"]
    assert (ch["verdict_then"], ch["verdict_now"], ch["why"]) == ("inconclusive", "held", "one-sided: a gain is not a cost")
    assert ch["fixed"]["kind"] == "similar" and ch["now"]["kind"] == "no_worse"
    text = "\n".join(change_lines({"w": ch}))
    assert "| w | kind similar | kind no_worse | inconclusive | held | one-sided: a gain is not a cost |" in text
    # the lock keeps the fixed definition and its verdict: shown again on the next write
    again = update_lock(tmp_path, [replace(changed, changed=None)], {"w": "held"}, has_records=True, today="d3")
    assert again["w"]["verdict_then"] == "inconclusive" and again["w"]["why"] == "no reason given"
    # put back, it is the fixed claim again; a claim added later is fixed and marked so
    extra = replace(C, id="new")
    assert update_lock(tmp_path, [C, extra], {"w": "inconclusive"}, has_records=True, today="d4") == {}
    assert json.loads((tmp_path / "claims.lock.json").read_text())["new"]["added_after_data"] is True


def test_a_verdict_that_moves_under_a_fixed_definition_says_whether_the_rules_or_the_records_moved_it(tmp_path):
    """Issue 35 item 8: the README says what changed from the previous verdicts and why."""
    # a lock written before the rules were recorded: judged by the first rules (the bootstrap)
    (tmp_path / "claims.lock.json").write_text(json.dumps(
        {"w": {"fixed": definition(C), "hash": definition_hash(C), "fixed_on": "d0", "verdict": "contradicted"}}))
    assert moved_lines(tmp_path) == []
    assert update_lock(tmp_path, [C], {"w": "budget-bound"}, has_records=True, today="d1") == {}
    entry = json.loads((tmp_path / "claims.lock.json").read_text())["w"]
    assert entry["verdict"] == "budget-bound" and entry["rules"] == RULES
    assert entry["history"] == [{"verdict": "contradicted", "rules": "bootstrap", "until": "d1"}]
    text = "\n".join(moved_lines(tmp_path))
    assert f"| w | contradicted | d1 | budget-bound | the rules: bootstrap → {RULES} |" in text
    assert "**bootstrap**: the two-level bootstrap" in text
    # the same verdict again moves nothing; new records under the same rules say so
    update_lock(tmp_path, [C], {"w": "budget-bound"}, has_records=True, today="d2")
    assert len(json.loads((tmp_path / "claims.lock.json").read_text())["w"]["history"]) == 1
    update_lock(tmp_path, [C], {"w": "held"}, has_records=True, today="d3")
    assert "| w | budget-bound | d3 | held | the records (runs added or continued) |" in "\n".join(moved_lines(tmp_path))
    # a claim whose arms had not run yet gets its first verdict: no move
    other = replace(C, id="o")
    update_lock(tmp_path, [C, other], {"w": "held", "o": "not run"}, has_records=True, today="d4")
    update_lock(tmp_path, [C, other], {"w": "held", "o": "held"}, has_records=True, today="d5")
    assert "history" not in json.loads((tmp_path / "claims.lock.json").read_text())["o"]


def test_one_claim_id_is_one_kind_in_every_shipped_study():
    assert same_kind_across_studies([load_study(n) for n in available()]) == []


def test_the_check_names_a_claim_judged_two_ways(tmp_path):
    class S:
        def __init__(self, name, claims):
            self.name, self.claims = name, claims
    bad = same_kind_across_studies([S("x", [C]), S("y", [replace(C, kind="no_worse")])])
    assert bad == ["w: x judges it as similar, y as no_worse"]


def test_the_readme_and_the_index_show_a_change_after_the_data(tmp_path):
    from normlab.study.claims import judge
    from normlab.study.index import update_index
    from normlab.study.records import load_records
    from normlab.study.readme import write_study

    from study_files import record, write_study_file

    def write(kind, changed=None):
        c = {"id": "c", "claim": "A about as good as B", "source": "paper", "paper": "+0", "better": "a",
             "than": "b1", "interval": "t", "kind": kind, "margin": 1.0, "carried_from": "language models",
             **({"changed": changed} if changed else {})}
        study = load_study(str(write_study_file(tmp_path, [c])))
        by_arm = load_records(out)
        return write_study(study, by_arm, judge(study, by_arm, None), out, "normlab-study s").read_text()

    out = tmp_path / "experiments" / "s"
    for arm, base in (("a", 25.0), ("b1", 24.0)):
        for seed in (1, 2, 3):
            record(out, arm, seed, test_bleu=base + 0.1 * seed, valid_bleu=20.0)
    first = write("similar")
    assert "Claims changed after the data" not in first
    text = write("no_worse", changed="one-sided: a gain is no cost")
    assert "## Claims changed after the data" in text
    assert "| c | kind similar | kind no_worse | inconclusive | held | one-sided: a gain is no cost |" in text
    assert "**held** (changed after the data; was inconclusive)" in text
    update_index(tmp_path / "experiments" / "README.md")
    index = (tmp_path / "experiments" / "README.md").read_text()
    assert "[carried from language models to MT]" in index and "(changed after the data; was inconclusive)" in index
