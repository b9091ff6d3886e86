"""Debugging the Lightning way (conf/debug, lightning-hydra-template's debug configs): fast_dev_run
and limit_*_batches complete, and their BLEU is over what was decoded, marked partial."""
import itertools
import json

import pytest

from normlab.data.datamodule import TranslationDataModule
from normlab.data.tokenizer import Tokenizer
from normlab.evaluation import score
from normlab.train import run

from conftest import compose_cfg, tiny_overrides


def debug_run(option: str, small_corpus, tmp_path, *extra: str) -> tuple[dict, object]:
    cfg = compose_cfg([f"debug={option}", *tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache"),
                       "data.eval_max_tokens=256", *extra])  # several eval batches, so a limit cuts the split
    return run(cfg), cfg


@pytest.mark.integration
def test_fast_dev_run(small_corpus, tmp_path):
    results, _ = debug_run("fdr", small_corpus, tmp_path)
    assert results["status"] == "completed" and results["steps"] == 1
    assert set(results["partial"]) == {"valid", "test"} and isinstance(results["test_bleu"], float)
    assert results["checkpoint"] == "final weights"  # fast_dev_run saves no checkpoint
    # an untrained model decodes to the cap: |src| + 5 as debug=limit (tests/test_length_cap.py), not + 50
    assert results["decoders"]["test"]["max_len_b"] == results["decoders"]["valid"]["max_len_b"] == 5


@pytest.mark.integration
def test_limited_batches_score_what_was_decoded(small_corpus, tmp_path):
    results, cfg = debug_run("limit", small_corpus, tmp_path, "trainer.max_steps=4", "trainer.val_check_interval=2")
    assert results["status"] == "completed" and results["steps"] == 4
    n_valid, n_test = (int(results["partial"][s].split(" of ")[0]) for s in ("valid", "test"))
    assert 0 < n_valid < 40 and 0 < n_test < 40 and results["partial"]["test"].endswith("of 40 sentences")
    # an independent computation: the test split's first 2 batches, as the data module builds them
    data = {k: v for k, v in json.loads(json.dumps(dict(cfg.data), default=str)).items() if k != "_target_"}
    data["max_positions"] = cfg.model.max_positions
    dm = TranslationDataModule(**data, tokenizer=Tokenizer.load(tmp_path / "run" / "tokenizer"))
    dm.setup("test")
    idx = sorted(i for b in itertools.islice(dm.dataloader("test"), 2) for i in b["idx"].tolist())
    hyps = (tmp_path / "run" / "test.hyp").read_text().splitlines()
    assert len(idx) == len(hyps) == n_test
    refs = dm.references("test")
    assert results["test_bleu"] == score(hyps, [refs[i] for i in idx])["bleu"]
    # an untrained model writes to the length cap: debug=limit caps it at |src| + 5 tokens
    assert results["decoders"]["test"]["max_len_b"] == results["decoders"]["valid"]["max_len_b"] == 5


def test_debug_options_compose():
    for option, key, value in [("fdr", "fast_dev_run", True), ("limit", "limit_val_batches", 2),
                               ("overfit", "overfit_batches", 2), ("profiler", "max_steps", 50)]:
        cfg = compose_cfg([f"debug={option}"])
        assert cfg.trainer[key] == value and set(cfg.logger) == {"csv"} and list(cfg.tags) == ["debug"]
    assert compose_cfg(["debug=overfit"]).data.shuffle is False


@pytest.mark.integration
def test_partial_is_kept_for_every_pass(small_corpus, tmp_path):
    """With the greedy and averaged test passes on, results.json's `partial` names every pass that
    scored part of its split (was: the last pass's dict replaced the beam pass's, so a partial test
    BLEU read as a full one)."""
    results, _ = debug_run("limit", small_corpus, tmp_path, "trainer.max_steps=4", "trainer.val_check_interval=2",
                           "eval.test_greedy=true", "eval.test_average=true", "eval.test_decoder.beam=2",
                           "eval.test_decoder.max_len_b=5", "eval.decoder.max_len_b=5",
                           "callbacks.step_checkpoints.every_n_steps=1", "callbacks.step_checkpoints.keep_last_n=2")
    assert isinstance(results["test_bleu_greedy"], float) and isinstance(results["test_bleu_avg"], float)
    assert set(results["partial"]) == {"valid", "test", "test_greedy", "test_avg"}


@pytest.mark.integration
def test_a_debug_run_has_its_own_folder(small_corpus, tmp_path, monkeypatch):
    """The folder Hydra names for `python train.py debug=fdr` is outputs/debug-fdr-<run name>: never the
    run it debugs (README: its RUN= glob, tests/test_readme_examples.py), whose folder stays as it was."""
    from normlab import identity
    from normlab.commands.train import main

    monkeypatch.chdir(tmp_path)
    over = [o for o in tiny_overrides(small_corpus, tmp_path / "x", tmp_path / "cache") if not o.startswith("++run_dir")]
    assert main(["debug=fdr", *over, "data.eval_max_tokens=256"]) == 0
    (folder,) = (tmp_path / "outputs").iterdir()
    debugged = identity.run_name(compose_cfg(over))
    assert folder.name == f"debug-fdr-tiny-test-{identity.identity_hash(compose_cfg(['debug=fdr', *over, 'data.eval_max_tokens=256']))}"
    assert folder.name != debugged and debugged.startswith("tiny-test-")
    assert json.loads((folder / "results.json").read_text())["labels"]["debug"] == "fdr"


@pytest.mark.integration
def test_debug_runs_run_again_and_write_no_checkpoint(small_corpus, tmp_path, capsys):
    """debug=fdr twice with the same command: both train (never 'already completed'), status debug,
    and no checkpoint file anywhere in the run folder (was: full-step1.ckpt and last.ckpt)."""
    from normlab.commands.train import main

    run_dir = tmp_path / "run"
    over = [o for o in tiny_overrides(small_corpus, run_dir, tmp_path / "cache") if not o.startswith("++run_dir")]
    args = ["debug=fdr", *over, "data.eval_max_tokens=256", f"hydra.run.dir={run_dir}"]
    for attempt in (1, 2):
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "already" not in out, attempt
        res = json.loads((run_dir / "results.json").read_text())
        assert res["status"] == "debug" and res["steps"] == 1 and res["choices"]["debug"] == "fdr"
        assert not list(run_dir.rglob("*.ckpt")), attempt
