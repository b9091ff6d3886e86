"""Continuing a pruned HybridNorm* model (issue 20), end to end: train, prune away layer 0 of both
stacks, `finetune=` the pruned weights (docs/runs-that-survive.md's way to go on training a pruned model: the prune
command writes weights-only checkpoints, which `resume=` refuses), then `resume=` that run and rerun
it after a crash. The rebuilt first layer of each stack gets HybridNorm*'s pre-norm input norm, the
kept layer has none: its load pre-hook removes the norm (schemes/recent.py), which check_weights_fit
must accept (it compared the keys and refused). At each start the model is the one it continues, bit
for bit; a real mismatch (a typed model.encoder_ffn) is still one ConfigError line."""
import copy

import pytest
import torch
from torch import nn

from normlab.callbacks.full_checkpoint import full_checkpoints
from normlab.checkpoint import load_model, save_model
from normlab.commands.train import main as train_main
from normlab.lit_module import Seq2SeqModule
from normlab.regularizers.pruning import prune
from normlab.train import run

from conftest import compose_cfg, tiny_overrides
from test_user_errors import one_error_line

pytestmark = pytest.mark.integration  # every test trains or runs a command through the entry point

FINETUNE_STEPS = 3


def plain(corpus, run_dir, cache, *more) -> list[str]:
    # the model (norm.placement included) comes from the checkpoint: no model.* overrides
    return [o for o in tiny_overrides(corpus, run_dir, cache) if not o.startswith("model.")] + [
        "eval.test=false", "eval.valid_bleu=false", *more]


@pytest.fixture(scope="module")
def pruned(small_corpus, tmp_path_factory):
    """(root, pruned checkpoint): HybridNorm* 2+2 trained 4 steps, layer 1 of each stack kept, saved as
    the prune command saves it (save_model of regularizers.pruning.prune's model)."""
    root = tmp_path_factory.mktemp("hybrid_star")
    run(compose_cfg(tiny_overrides(small_corpus, root / "run", root / "cache") + [
        "norm=hybrid_star", "trainer.max_steps=4", "eval.test=false", "eval.valid_bleu=false"]))
    model, tok = load_model(full_checkpoints(root / "run" / "checkpoints")[0][1])
    assert model.encoder.layers[0].self_attn.pre_norm_layer  # HybridNorm*'s pre-norm first layer
    keep = {"encoder_layers": [1], "decoder_layers": [1]}
    return root, save_model(root / "pruned.ckpt", prune(model, [1], [1]), tok.proto,
                            pruned_from={"strategy": "by hand", **keep})


def recording(mp) -> list:
    """The model as each run's training starts (restored, optimizers built): a list, one per run."""
    seen = []
    mp.setattr(Seq2SeqModule, "on_train_start", lambda self: seen.append(copy.deepcopy(self.model)))
    return seen


@pytest.fixture
def at_start(monkeypatch):
    return recording(monkeypatch)


def check_continues(model, previous) -> None:
    # the kept (formerly second) layer: HybridNorm's, no input norm on its attentions; and the same
    # function, bit for bit, as the model it continues
    for block in (model.encoder.layers[0].self_attn, model.decoder.layers[0].self_attn,
                  model.decoder.layers[0].cross_attn):
        assert not block.pre_norm_layer and isinstance(block.norm, nn.Identity)
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(4, 300, (3, 7), generator=g), torch.randint(4, 300, (3, 6), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(src, tgt), previous.eval()(src, tgt), rtol=0, atol=0)


def newest(run_dir):
    return full_checkpoints(run_dir / "checkpoints")[0][1]


@pytest.fixture(scope="module")
def finetuned(pruned, small_corpus):
    root, ckpt = pruned
    with pytest.MonkeyPatch.context() as mp:
        seen = recording(mp)
        results = run(compose_cfg(plain(small_corpus, root / "ft", root / "cache", f"finetune={ckpt}",
                                        f"trainer.max_steps={FINETUNE_STEPS}")))
    return root / "ft", results, seen[0]


def test_finetune_a_pruned_hybrid_star_model(pruned, finetuned):
    _, ckpt = pruned
    run_dir, results, start = finetuned
    before, _ = load_model(ckpt)
    check_continues(start, before)
    assert results["status"] == "completed" and results["steps"] == FINETUNE_STEPS
    assert results["params"] == before.num_parameters()
    after, _ = load_model(newest(run_dir))
    assert any(not torch.equal(p, q) for p, q in zip(after.parameters(), before.parameters()))  # it trained


def test_resume_a_finetuned_pruned_hybrid_star_run(pruned, finetuned, small_corpus, at_start):
    root, _ = pruned
    ft_dir, ft_results, _ = finetuned
    steps = FINETUNE_STEPS + 2
    results = run(compose_cfg(plain(small_corpus, root / "resumed", root / "cache", f"resume={ft_dir}",
                                    f"trainer.max_steps={steps}")))
    assert results["status"] == "completed" and results["steps"] == steps  # the step count goes on
    assert results["params"] == ft_results["params"]
    previous, _ = load_model(newest(ft_dir))
    check_continues(at_start[0], previous)


def test_a_crashed_finetune_of_a_pruned_hybrid_star_model_continues(pruned, small_corpus, at_start):
    # The rerun restores the run folder's own checkpoint (Lightning, strict, with the pre-hook)
    root, ckpt = pruned
    cfg = compose_cfg(plain(small_corpus, root / "crashed", root / "cache", f"finetune={ckpt}",
                            f"trainer.max_steps={FINETUNE_STEPS}", "callbacks.full_checkpoint.every_n_steps=1"))
    step = Seq2SeqModule.training_step

    def crash_at_2(self, *args):
        if self.global_step == 2:
            raise RuntimeError("crash at step 2")
        return step(self, *args)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(RuntimeError, match="crash at step 2"):
        mp.setattr(Seq2SeqModule, "training_step", crash_at_2)
        run(cfg)
    saved, _ = load_model(newest(root / "crashed"))
    results = run(cfg)
    assert results["status"] == "completed" and results["steps"] == FINETUNE_STEPS
    assert results["params"] == load_model(ckpt)[0].num_parameters()
    check_continues(at_start[-1], saved)


def test_resume_with_a_model_that_does_not_fit_is_one_error(pruned, finetuned, small_corpus, tmp_path, monkeypatch,
                                                            capsys):
    # from the command line (train.py's main): a typed model key wins over the checkpoint's only there
    root, _ = pruned
    ft_dir = finetuned[0]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NORMLAB_TRACEBACK", raising=False)
    args = [a for a in plain(small_corpus, tmp_path / "wider", root / "cache") if not a.startswith("++run_dir")]
    assert train_main([*args, f"resume={ft_dir}", f"trainer.max_steps={FINETUNE_STEPS + 2}", "model.encoder_ffn=128",
                       f"hydra.run.dir={tmp_path / 'wider'}"]) == 2
    assert one_error_line(capsys) == (
        f"error: resume={newest(ft_dir)}: the checkpoint's weights do not fit the model the command line builds "
        "(first difference: model.encoder.layers.0.ffn.sublayer.fc1.weight); drop the model overrides, or use finetune=")
    assert not (tmp_path / "wider").exists()
