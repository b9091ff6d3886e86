"""A start checkpoint the run refuses (`resume=` / `finetune=`) is one line (issue 37 item 8), as
`python train.py` prints it: weights that do not fit the model, a checkpoint already at
trainer.max_steps, a file that is not a checkpoint. Exit status 2, nothing before the line (the
checkpoint is checked before the run logs its tokens per update, and where it holds its tokenizer,
before the corpus is read), no traceback, no run folder."""
import pickle
import random

import pytest
import torch

from conftest import refused, tiny_overrides

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def start(small_corpus, tmp_path_factory):
    """A 2-step run's full checkpoint (it holds its tokenizer)."""
    from normlab.train import run

    from conftest import compose_cfg

    tmp = tmp_path_factory.mktemp("start")
    results = run(compose_cfg(tiny_overrides(small_corpus, tmp / "run", tmp / "cache") + ["trainer.max_steps=2"]))
    assert results["status"] == "completed"
    return tmp / "run" / "checkpoints" / "last.ckpt"


def _args(corpus, tmp_path, *extra) -> list[str]:
    # the model settings are the checkpoint's; a new cache: the corpus is read (and checked) afresh
    base = [a for a in tiny_overrides(corpus, tmp_path / "new", tmp_path / "cache")
            if not a.startswith(("model.", "trainer.max_steps"))]
    return [*base, *extra]


@pytest.mark.parametrize("key, override, says", [
    ("finetune", "model.encoder_ffn=40", "the weights do not fit the model: size mismatch for "),
    ("resume", "model.encoder_ffn=40", "the checkpoint's weights do not fit the model the command line builds "
                                       "(first difference: model.encoder.layers.0.ffn."),
])
def test_weights_that_do_not_fit_are_one_line(key, override, says, start, small_corpus, tmp_path):
    line = refused(_args(small_corpus, tmp_path, f"{key}={start}", override, "trainer.max_steps=4"), tmp_path, here=True)
    assert line.startswith(f"error: {key}={start}: {says}"), line
    assert not (tmp_path / "new").exists() and not (tmp_path / "cache").exists()  # refused before the corpus


def test_resume_past_max_steps_is_one_line(start, small_corpus, tmp_path):
    line = refused(_args(small_corpus, tmp_path, f"resume={start}", "trainer.max_steps=2"), tmp_path)  # as a user runs it
    assert line == (f"error: resume={start}: the checkpoint is at step 2: trainer.max_steps=2 leaves nothing to "
                    "train (set it above 2, or use finetune= to start the step count afresh)")
    assert not (tmp_path / "new").exists()


def _random_bytes(path):
    rng = random.Random(37)
    data = bytes(rng.randrange(256) for _ in range(4096))
    path.write_bytes(b"\xfe" + data)  # 0xfe is no pickle opcode: the unpickler stops at the first byte


def _raw_pickle(path):
    with open(path, "wb") as f:  # plain pickle, not torch.save: a dict of plain values
        pickle.dump({"state_dict": {}, "model_config": {"d_model": 8}, "global_step": 3}, f, protocol=4)


def _tensor_pickle(path):
    with open(path, "wb") as f:  # plain pickle of tensors: unpickling them calls torch.load on their bytes
        pickle.dump({"state_dict": {"w": torch.zeros(2)}}, f, protocol=4)


@pytest.mark.parametrize("key", ["resume", "finetune"])
@pytest.mark.parametrize("make, what", [
    (_random_bytes, "not a readable checkpoint, truncated or not a torch file (UnpicklingError: Unsupported "
                    "operand 254)"),
    (_raw_pickle, "not a torch checkpoint: a plain pickle (protocol 4), not a file torch.save wrote"),
    (_tensor_pickle, "not a torch checkpoint: a plain pickle (protocol 4), not a file torch.save wrote"),
])
def test_a_file_that_is_not_a_checkpoint_is_one_line_that_says_so(key, make, what, small_corpus, tmp_path):
    """Random bytes are not "a Python object"; a plain pickle prints no warning of torch's first."""
    path = tmp_path / "start.ckpt"
    make(path)
    line = refused(_args(small_corpus, tmp_path, f"{key}={path}", "trainer.max_steps=4"), tmp_path, here=True)
    assert line.startswith(f"error: {path}: {what}"), line
    assert "Python object" not in line and "weights_only" not in line
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("key", ["finetune", "resume"])
def test_a_checkpoint_without_its_tokenizer_is_refused_before_the_corpus_is_read(key, start, small_corpus,
                                                                                 tmp_path):
    """Weights without the tokenizer they were trained with (a model saved without tokenizer_proto):
    their embedding rows cannot be matched to this corpus's token ids (translate and evaluate refuse
    such a file too). Refused before any work, the corpus unread (was: the corpus was read and a
    tokenizer trained first; then a vocabulary of another size was refused as weights that do not
    fit, and one of the same size trained on, whatever ids the weights had learnt)."""
    ckpt = torch.load(start, map_location="cpu", weights_only=True)
    del ckpt["tokenizer_proto"]
    path = tmp_path / "no_tokenizer.ckpt"
    torch.save(ckpt, path)
    line = refused(_args(small_corpus, tmp_path, f"{key}={path}", "trainer.max_steps=4"), tmp_path, here=True)
    assert line == (f"error: {key}={path}: not a normlab checkpoint (no tokenizer_proto): the token ids its weights "
                    "were trained on cannot be matched to this corpus's; start from a checkpoint a normlab run wrote "
                    "(<run>/checkpoints/*.ckpt)"), line
    assert not (tmp_path / "new").exists() and not (tmp_path / "cache").exists()  # refused before the corpus
