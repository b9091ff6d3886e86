"""Pruning: every-other vs the paper's formula, search, data-driven, surgery == skipped forward,
save/load; and train -> prune command -> decode on a tiny run."""
import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from normlab.checkpoint import load_model, resolve_checkpoint, save_model
from normlab.config import ModelConfig
from normlab.model.schemes import SCHEMES
from normlab.model.transformer import Seq2SeqTransformer
from normlab.regularizers.pruning import data_driven, every_other, prune, search_on_valid

from conftest import compose_cfg, tiny_overrides

V = 29


def paper_every_other(n, r):
    # Fan et al. 2019: p = 1 - r/N, drop depths d (from 1) with d = 0 mod floor(1/p)
    p = 1 - r / n
    k = math.floor(1 / p + 1e-9)
    return [d - 1 for d in range(1, n + 1) if d % k != 0]


@pytest.mark.parametrize("n,r", [(6, 3), (6, 4), (6, 5), (12, 6), (12, 8), (16, 8), (7, 4), (12, 9)])
def test_every_other_is_the_papers_formula(n, r):
    assert every_other(n, r) == paper_every_other(n, r)
    assert len(every_other(n, r)) == r


def test_every_other_worked_examples_and_fallback():
    assert every_other(6, 3) == [0, 2, 4]  # drop depths 2, 4, 6
    assert every_other(16, 8) == list(range(0, 16, 2))  # fairseq's README example "0,2,...,14"
    assert every_other(6, 6) == list(range(6))
    for n in range(2, 13):  # where the formula does not give N - r layers, still r evenly spaced ones
        for r in range(1, n + 1):
            keep = every_other(n, r)
            assert len(keep) == r and keep == sorted(set(keep)) and 0 <= keep[0] and keep[-1] < n
    with pytest.raises(ValueError):
        every_other(6, 0)


def test_search_on_valid_exhaustive_and_greedy():
    calls = []
    weights_e, weights_d = [5, 1, 4, 2, 3, 0], [0, 3, 1, 2]

    def score(ke, kd):
        calls.append((tuple(ke), tuple(kd)))
        return sum(weights_e[i] for i in ke) + sum(weights_d[i] for i in kd)

    best = ([0, 2, 4], [1, 3])
    assert search_on_valid(6, 4, 3, 2, score) == best
    assert len(calls) == math.comb(6, 3) + math.comb(4, 2)  # exhaustive per stack
    calls.clear()
    assert search_on_valid(6, 4, 3, 2, score, max_exhaustive=0) == best  # greedy finds additive optima
    assert len(calls) == (6 + 5 + 4) + (4 + 3)


def cfg(**reg) -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=16, encoder_layers=6, decoder_layers=5, encoder_heads=2, decoder_heads=2,
                       encoder_ffn=24, decoder_ffn=24, max_positions=32, regularizer=reg)


def test_data_driven_prunes_the_largest_learned_rates():
    torch.manual_seed(0)
    m = Seq2SeqTransformer(cfg(encoder_layerdrop=0.3, decoder_layerdrop=0.3, layerdrop_rates="learned"))
    with torch.no_grad():
        m.encoder.layers.rate_logits.copy_(torch.tensor([0.1, 2.0, -1.0, 0.5, 3.0, 0.0]))
        m.decoder.layers.rate_logits.copy_(torch.tensor([1.0, -2.0, 0.3, 0.2, 0.0]))
    assert data_driven(m, 3, 2) == ([0, 2, 5], [1, 4])
    with pytest.raises(ValueError, match="learned"):
        data_driven(Seq2SeqTransformer(cfg()), 3, 2)


class Identity(nn.Module):
    def forward(self, x, *args, **kwargs):
        return x


@pytest.mark.parametrize("placement", list(SCHEMES))
@pytest.mark.parametrize("reg", [{}, {"encoder_layerdrop": 0.2, "decoder_layerdrop": 0.2},
                                 {"encoder_layerdrop": 0.2, "decoder_layerdrop": 0.2, "layerdrop_rates": "learned"}])
def test_pruned_equals_skipped_forward_and_survives_save_load(placement, reg, tmp_path):
    torch.manual_seed(0)
    c = cfg(**reg)
    c.norm.placement, c.norm.type = placement, "none" if SCHEMES[placement].norm_free else "layernorm"
    c.bias = placement != "ngpt"  # nGPT's projections have no biases (it refuses model.bias=true)
    m = Seq2SeqTransformer(c).eval()
    keep_e, keep_d = [0, 3, 5], [1, 2]  # not consecutive
    pruned = prune(m, keep_e, keep_d)
    assert (pruned.cfg.encoder_layers, pruned.cfg.decoder_layers) == (3, 2)
    assert (m.cfg.encoder_layers, len(m.encoder.layers)) == (6, 6)  # the original is untouched
    ref = Seq2SeqTransformer(c).eval()
    ref.load_state_dict(m.state_dict())
    for stack, keep in ((ref.encoder, keep_e), (ref.decoder, keep_d)):
        for i in range(len(stack.layers)):
            if i not in keep:
                stack.layers[i] = Identity()  # the skipped layers
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, V, (3, 7), generator=g), torch.randint(3, V, (3, 5), generator=g)
    src[1, 4:] = 0
    out = pruned(src, tgt)
    assert torch.equal(out, ref(src, tgt))
    path = save_model(tmp_path / "pruned.ckpt", pruned, tokenizer_proto=None)
    loaded, tok = load_model(path)
    assert tok is None and loaded.cfg == pruned.cfg
    assert torch.equal(loaded(src, tgt), out)
    assert sum(p.numel() for p in loaded.parameters()) < sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_pruning_a_dlcl_stack_removes_the_layers_from_its_history(placement, tmp_path):
    # DLCL (Wang et al. 2019): the pruned stack is the DLCL of the kept layers, whose weights are
    # W's rows and columns of y_0 and the kept layers' outputs, with the kept layers' norms.
    torch.manual_seed(0)
    c = ModelConfig(vocab_size=V, d_model=16, encoder_layers=6, decoder_layers=5, encoder_heads=2, decoder_heads=2,
                    encoder_ffn=24, decoder_ffn=24, max_positions=32, layer_aggregation="dlcl",
                    norm={"placement": placement})
    m = Seq2SeqTransformer(c).eval()
    with torch.no_grad():
        m.encoder.aggregation.weight.add_(torch.rand(7, 7))  # away from the average
    keep = [0, 3, 5]
    pruned = prune(m, keep, [1, 2])
    agg = pruned.encoder.aggregation
    idx = [0, 1, 4, 6]
    torch.testing.assert_close(agg.weight, m.encoder.aggregation.weight[idx][:, idx])
    assert len(agg.norms) == 3 and agg.weight.shape == (4, 4)
    for k, kept in enumerate(keep):
        torch.testing.assert_close(agg.norms[k].weight, m.encoder.aggregation.norms[kept].weight)
    assert m.encoder.aggregation.weight.shape == (7, 7)  # the original is untouched
    src = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(2))
    ref = m.encoder.aggregation.subset(keep)  # the same computation on the original layers
    x = ref(nn.ModuleList(m.encoder.layers[i] for i in keep), m.encoder.embed(src), src.eq(0))
    torch.testing.assert_close(pruned.encode(src)[0], m.encoder.final_norm(x))
    loaded, _ = load_model(save_model(tmp_path / "p.ckpt", pruned, tokenizer_proto=None))
    torch.testing.assert_close(loaded.encode(src)[0], pruned.encode(src)[0])


def test_prune_rejects_bad_subsets():
    m = Seq2SeqTransformer(cfg())
    for ke, kd in (([], [0]), ([0, 0], [1]), ([6], [0])):
        with pytest.raises(ValueError):
            prune(m, ke, kd)


# ---- end to end: train -> prune command -> decode ------------------------------------------------
@pytest.fixture(scope="module")
def layerdrop_run(small_corpus, tmp_path_factory):
    from normlab.train import run

    run_dir = tmp_path_factory.mktemp("ldrun")
    overrides = tiny_overrides(small_corpus, run_dir, run_dir.parent / "cache") + [
        "regularizer=layerdrop_drophead", "regularizer.layerdrop_rates=learned", "regularizer.encoder_layerdrop=0.5",
        "regularizer.decoder_layerdrop=0.5", "model.encoder_layers=4", "model.decoder_layers=4",
        "eval.test=false", "eval.valid_bleu=false", "callbacks.step_checkpoints.keep_last_n=0", "trainer.log_every_n_steps=1"]
    cfg = compose_cfg(overrides)
    results = run(cfg)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")  # as a Hydra run leaves it
    return run_dir, results


def test_drophead_schedule_logged_during_training(layerdrop_run):
    import csv

    from normlab.regularizers.rate_schedules import schedule_value

    run_dir, _ = layerdrop_run
    rows = [r for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("regularizer/drophead_p")]
    assert rows
    assert len(rows) == 8
    for r in rows:  # logged at step = optimizer steps done = global_step; the schedule's step is + 1
        step = int(r["step"])
        assert float(r["regularizer/drophead_p"]) == pytest.approx(schedule_value("v_shape", step + 1, 0.2, total=8, warmup=4))


def test_train_prune_decode(layerdrop_run, capsys):
    from normlab.commands.prune import main
    from normlab.evaluation import make_decoder, ordered, score, translate_batches

    run_dir, _ = layerdrop_run
    out = run_dir / "pr"
    args = [str(run_dir), "--depths", "2", "--beam", "1", "--max-sentences", "12", "--out", str(out),
            "--save-checkpoints", "-q"]
    assert main(args) == 0
    data = json.loads((out / "prune.json").read_text())
    rows = {r["strategy"]: r for r in data["rows"]}
    assert set(rows) == {"full", "every_other", "search_on_valid", "data_driven"}
    assert rows["every_other"]["encoder_layers"] == every_other(4, 2) == [0, 2]
    assert len(rows["data_driven"]["encoder_layers"]) == 2 and rows["data_driven"]["note"] == ""
    assert len(data["learned_rates"][0]) == 4 and sum(data["learned_rates"][0]) == pytest.approx(4 * 0.5, rel=1e-4)
    for ext in ("md", "csv", "png"):
        assert (out / f"prune.{ext}").stat().st_size > 0
    # a saved pruned model is an ordinary checkpoint: reload, decode, same BLEU as the table
    model, tok = load_model(out / "checkpoints" / "every_other-r2.ckpt")
    assert (model.cfg.encoder_layers, model.cfg.decoder_layers) == (2, 2)
    from normlab.commands.prune import Split
    from normlab.data.datamodule import TranslationDataModule

    data_cfg = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml").data, resolve=True)
    data_cfg.pop("_target_")
    dm = TranslationDataModule(**data_cfg, tokenizer=tok)
    dm.setup("test")
    refs = dm.references("test")[:12]
    from normlab.evaluation import lines_loader

    batches, _ = lines_loader(tok, dm.sources("test")[:12], model.cfg.max_positions, 8192)
    hyps = translate_batches(model, batches, make_decoder(beam=1), tok.decode)
    assert score(ordered(hyps, 12), refs)["bleu"] == rows["every_other"]["test_bleu"]
    # each model's test translations are kept, in corpus order: they score the table's BLEU
    kept = (out / "hyps" / "every_other-r2.test.hyp").read_text().split("\n")[:-1]
    assert kept == ordered(hyps, 12)
    for tag, row in (("full", rows["full"]), ("search_on_valid-r2", rows["search_on_valid"])):
        lines = (out / "hyps" / f"{tag}.test.hyp").read_text().split("\n")[:-1]
        assert score(lines, refs)["bleu"] == row["test_bleu"], tag
    # the same model from prune() in memory
    full, _ = load_model(resolve_checkpoint(run_dir))
    assert torch.equal(prune(full, [0, 2], [0, 2]).state_dict()["encoder.layers.1.ffn.sublayer.fc1.weight"],
                       model.state_dict()["encoder.layers.1.ffn.sublayer.fc1.weight"])
    # outputs are never overwritten without --force
    from normlab.commands.common import main_guard

    assert main_guard(main, args) == 2
    assert "exists" in capsys.readouterr().err
    assert main(args + ["--force", "--strategies", "every_other"]) == 0
