"""callbacks.full_checkpoint.every_n_steps=0 writes no full-state checkpoint, so a killed run cannot
continue (issue 37 item 8: it did so silently). A run says it in one warning line when it starts;
a debug run (conf/debug sets 0: it starts again from step 0 anyway) does not."""
import pytest

from conftest import tiny_overrides, train_cli, train_here

pytestmark = pytest.mark.integration

SHORT = ["trainer.max_steps=2", "eval.test=false", "callbacks.full_checkpoint.every_n_steps=0"]


@pytest.mark.parametrize("debug", [False, True], ids=["run", "debug run"])
def test_no_full_checkpoints_is_said_once_except_in_a_debug_run(debug, small_corpus, tmp_path):
    run = tmp_path / "run"
    args = [*tiny_overrides(small_corpus, run, tmp_path / "cache"), *SHORT] + (["debug=fdr"] if debug else [])
    code, lines = (train_here if debug else train_cli)(args, tmp_path)  # one as a user runs it, one in this process
    assert code == 0, lines
    said = [line for line in lines if "callbacks.full_checkpoint.every_n_steps=0" in line]
    assert len(said) == (0 if debug else 1), lines
    if not debug:
        from normlab.callbacks.full_checkpoint import NO_CONTINUATION

        assert said[0].split("] ", 1)[1] == f"warning: {NO_CONTINUATION}"  # the console's warning format
    assert not list((run / "checkpoints").glob("full-step*.ckpt"))  # what the line says: nothing to continue from
