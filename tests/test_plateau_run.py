"""callbacks.plateau: a run stops at a plateau of its validation loss or at the cap, and says which
(results.json `plateau`, issue 35 item 2); its curve survives a pause, so a continued run decides as
a straight one; off, names and hashes are unchanged (test_identity_pinned covers the pinned names)."""
import pytest

from normlab import identity
from normlab.config import ConfigError
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

RUN = ["trainer.max_steps=24", "trainer.val_check_interval=4", "eval.test=false", "eval.valid_bleu=false",
       "callbacks.full_checkpoint.every_n_steps=4"]


def _args(small_corpus, tmp_path, *more):
    return tiny_overrides(small_corpus, tmp_path / "run", tmp_path / "cache") + RUN + list(more)


@pytest.mark.integration
def test_a_run_stops_at_its_plateau_and_says_so_even_after_a_pause(small_corpus, tmp_path):
    # min_delta 100 nats: no window of 4 steps gains that much, so the first validation with a window
    # before it (step 8) is a plateau; the run paused at step 4 must remember step 4's value to see it
    args = _args(small_corpus, tmp_path, "callbacks.plateau.window=4", "callbacks.plateau.min_delta=100")
    paused = run(compose_cfg(args + ["callbacks.preemption.stop_at_step=4"]))
    assert (paused["status"], paused["steps"], paused["plateau"]["step"]) == ("stopped", 4, None)
    results = run(compose_cfg(args))
    assert (results["status"], results["steps"]) == ("completed", 8)
    assert results["plateau"]["step"] == 8 and results["plateau"]["cap"] == 24 and results["plateau"]["window"] == 4
    assert results["valid_loss"] > 0  # scored like any completed run


@pytest.mark.integration
def test_a_run_still_improving_at_the_cap_says_so(small_corpus, tmp_path):
    args = _args(small_corpus, tmp_path, "callbacks.plateau.window=8", "callbacks.plateau.min_delta=0")
    results = run(compose_cfg(args))
    # min_delta 0: a plateau only if the best loss did not fall at all over 8 steps (it falls, early on)
    assert results["steps"] == 24 and results["status"] == "completed"
    assert results["plateau"]["step"] is None and results["plateau"]["cap"] == 24


def test_off_by_default_keeps_the_identity_and_writes_nothing(small_corpus, tmp_path):
    base = compose_cfg(_args(small_corpus, tmp_path))
    assert "plateau" not in identity.identity(base).get("callbacks", {})
    on = compose_cfg(_args(small_corpus, tmp_path, "callbacks.plateau.window=500"))
    assert identity.identity_hash(on) != identity.identity_hash(base)


@pytest.mark.integration
@pytest.mark.parametrize("bad", ["callbacks.plateau.window=0", "callbacks.plateau.window=true",
                                 "callbacks.plateau.min_delta=-1"])
def test_bad_settings_are_one_line(small_corpus, tmp_path, bad):
    with pytest.raises(ConfigError, match=r"callbacks\.plateau\.(window|min_delta)="):
        run(compose_cfg(_args(small_corpus, tmp_path, bad)))
