"""Config refusals are one line each (issue 37 item 8), as `python train.py` prints them: a study
given to a run (`+study=NAME`, which used to train and rename the run), a config error in the
folder of a finished run (two `error:` lines), the callbacks' own settings (DropHead's p_start was
not checked; the divergence, stall and diagnostics callbacks' errors came inside Hydra's `Error in
call to target` wrapper). Exit status 2, nothing else printed, no run folder, nothing written into
a folder that was there."""
import json

import pytest

from conftest import refused, tiny_overrides, tree

pytestmark = pytest.mark.integration


def _tiny(corpus, tmp_path) -> list[str]:
    # were the setting accepted, a run of 2 steps on a small corpus (the code before trained it)
    return [*tiny_overrides(corpus, tmp_path / "run", tmp_path / "cache"), "trainer.max_steps=2", "eval.test=false"]


def test_a_study_given_to_a_run_is_refused(small_corpus, tmp_path):
    line = refused(["+study=drophead", *_tiny(small_corpus, tmp_path)], tmp_path, here=True)
    assert line == ("error: study=drophead: a study is run with normlab-study, not as a key of one run "
                    "(normlab-study drophead; normlab-study --list names them)")
    assert list(tmp_path.iterdir()) == []


def test_a_config_error_in_a_finished_run_folder_is_one_line_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"status": "completed", "test_bleu": 1.0, "steps": 8}))
    before = {k: v for k, v in tree(run).items() if not k.startswith(".hydra")}
    line = refused(["norm.type=batchnorm", "logger=csv", f"hydra.run.dir={run}"], tmp_path)
    assert line.startswith("error: norm.type: 'batchnorm' is not valid (allowed: ")
    # Hydra's own files (.hydra/, <job>.log) are written before the job; the run's are untouched
    assert {k: v for k, v in tree(run).items() if not k.startswith(".hydra") and not k.endswith(".log")} == before


CALLBACK_VALUES = [
    ("regularizer=drophead callbacks.drophead_schedule.p_start=2.0",
     "callbacks.drophead_schedule.p_start: 2.0 is not valid (allowed: a probability in [0, 1], or null for p)"),
    ("regularizer=drophead callbacks.drophead_schedule.warmup=-1",
     "callbacks.drophead_schedule.warmup: -1 is not valid (allowed: an integer >= 0, or null for optim.warmup)"),
    ("callbacks.divergence.factor=0.5",
     "callbacks.divergence.factor: 0.5 is not valid (allowed: a number > 1, or null to disable the explosion rule)"),
    ("callbacks.divergence.patience=0", "callbacks.divergence.patience: 0 is not valid (allowed: an integer >= 1)"),
    ("callbacks.stall.window=0", "callbacks.stall.window: 0 is not valid (allowed: an integer >= 1)"),
    ("callbacks.stall.stop_after=-1",
     "callbacks.stall.stop_after: -1 is not valid (allowed: an integer >= 0, or null: never stop early)"),
    ("+callbacks.stall.bogus=1", "callbacks.stall.bogus: not an option of this callback (allowed: window, patience, "
                                 "margin, min_delta, after_step, stop_after)"),
    ("callbacks.diagnostics.every_n_steps=-1",
     "callbacks.diagnostics.every_n_steps: -1 is not valid (allowed: an integer >= 0 (0: off))"),
    ("callbacks.observatory.enabled=maybe", "callbacks.observatory.enabled: 'maybe' is not valid (allowed: true, false)"),
    ("callbacks.observatory.window=0",
     "callbacks.observatory.window: 0 is not valid (allowed: an integer >= 1 (optimizer steps))"),
]


@pytest.mark.parametrize("override, says", CALLBACK_VALUES, ids=[o.split()[-1] for o, _ in CALLBACK_VALUES])
def test_a_bad_callback_setting_is_one_line_naming_the_key(override, says, small_corpus, tmp_path, monkeypatch,
                                                           capfd):
    """In process (the entry point's main), stdout and stderr read at the file descriptors: every
    line a user would see."""
    from normlab.commands.train import main

    monkeypatch.chdir(tmp_path)
    for var in ("HYDRA_FULL_ERROR", "NORMLAB_TRACEBACK"):
        monkeypatch.delenv(var, raising=False)
    assert main([*override.split(), *_tiny(small_corpus, tmp_path)]) == 2
    out = capfd.readouterr()
    assert [line for line in (out.out + out.err).splitlines() if line.strip()] == [f"error: {says}"]
    assert list(tmp_path.iterdir()) == []


def test_the_v_shaped_drophead_schedule_without_a_last_step_is_one_line(small_corpus, tmp_path):
    """regularizer=drophead (its V-shaped schedule) with trainer.max_steps=-1: refused before the corpus
    is read, naming both keys (was: the corpus read, then a ValueError traceback at the first batch)."""
    args = [a for a in _tiny(small_corpus, tmp_path) if not a.startswith("trainer.max_steps")]
    line = refused(["regularizer=drophead", "trainer.max_steps=-1", "trainer.max_epochs=1", *args], tmp_path, here=True)
    assert line.startswith("error: callbacks.drophead_schedule.schedule=v_shape: its rate rises to "
                           "regularizer.drophead at the last step, and trainer.max_steps=-1 sets none"), line
    assert list(tmp_path.iterdir()) == []
