"""A run folder's run.json or results.json that is damaged (empty, cut off, or valid JSON that is not
an object, e.g. a list) is named in one warning line and treated as missing (issue 37 item 6): the
run trains or continues and writes the file anew. A list used to end the command with an
AttributeError (run_folder.prepare, existing_name) or a TypeError (failure.record_failure)."""
import json
import logging

import pytest

from normlab.run_folder import existing_name, prepare

DAMAGED = [("[1, 2]", "a JSON list, not a JSON object"), ('"completed"', "a JSON string, not a JSON object"),
           ("3", "a JSON number, not a JSON object"), ('{"status": "compl', "not JSON (cut off at byte 17?)"),
           ("", "empty")]


@pytest.mark.parametrize("content, problem", DAMAGED, ids=[p.split(",")[0] for _, p in DAMAGED])
@pytest.mark.parametrize("name", ["run.json", "results.json"])
def test_a_damaged_record_is_named_once_and_treated_as_missing(name, content, problem, tmp_path, caplog):
    (tmp_path / name).write_text(content)
    with caplog.at_level(logging.WARNING, logger="normlab"):
        cont = prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=False)
    assert caplog.messages == [f"{tmp_path / name}: {problem}: treated as missing (the run writes it anew)"]
    assert cont.finished is None and cont.checkpoint is None  # not finished: it trains
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["identity_hash"] == "h1" and record["attempt"] == 0  # a new record of this run


def test_an_undamaged_folder_says_nothing(tmp_path, caplog):
    (tmp_path / "results.json").write_text(json.dumps({"status": "completed", "steps": 8}))
    with caplog.at_level(logging.WARNING, logger="normlab"):
        cont = prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=False)
    assert caplog.messages == [] and cont.finished == {"status": "completed", "steps": 8}


def test_a_damaged_run_json_is_not_the_run_an_earlier_release_named(tmp_path):
    (tmp_path / "a-h1").mkdir()
    (tmp_path / "a-h1" / "run.json").write_text("[]")
    assert existing_name(tmp_path, "new-h1") == "new-h1"
    (tmp_path / "b-h1").mkdir()
    (tmp_path / "b-h1" / "run.json").write_text(json.dumps({"identity_hash": "h1"}))
    assert existing_name(tmp_path, "new-h1") == "b-h1"


def test_a_failure_in_a_folder_with_a_damaged_results_json_is_recorded(tmp_path):
    from conftest import compose_cfg

    from normlab.failure import record_failure

    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text("[1, 2]")
    assert record_failure(compose_cfg(["logger=csv", f"++run_dir={run}"]), RuntimeError("boom")) is False
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "failed" and results["error"] == "RuntimeError: boom"
