"""Beam search: exact against exhaustive enumeration, cached == uncached, limits, n-best order."""
import itertools
import math

import pytest
import torch

from normlab.config import ModelConfig
from normlab.decoding.beam import beam_search, length_penalty
from normlab.decoding.greedy import greedy_decode
from normlab.evaluation import make_decoder
from normlab.model.transformer import Seq2SeqTransformer

PAD, BOS, EOS = 0, 1, 2


def tiny(V=11, **kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_heads=2,
                decoder_heads=2, encoder_ffn=24, decoder_ffn=24, max_positions=64)
    return ModelConfig(**{**base, **kw})


def model_of(seed=0, V=11, **kw) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(tiny(V, **kw)).eval()
    with torch.no_grad():  # Admin's ω starts at 1, ReZero's a at 0, DLCL's weights at the mean, DWA's
        # at the identity: make them matter
        for name, p in model.named_parameters():
            if name.endswith("omega"):
                p.uniform_(0.5, 2.0)
            elif name.endswith(".scale"):
                p.uniform_(0.5, 1.0)
            elif name.endswith("aggregation.weight"):
                p.add_(torch.rand_like(p) * 0.5)
    return model


def source(B=6, S=6, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (B, S), generator=g)
    src[:, -1] = EOS
    for row in range(1, B, 2):  # padded rows of several lengths, EOS before the padding
        n = S - 1 - row % (S - 1)
        src[row, n:] = PAD
        src[row, n - 1] = EOS
    return src


def unpadded(row: torch.Tensor) -> torch.Tensor:
    return row[row.ne(PAD)][None]


def sequence_logprob(model, src_row: torch.Tensor, tokens: list[int]) -> float:
    # Reference: full (uncached) forward of BOS + y, log-softmax over the whole vocabulary,
    # summed over y + EOS.
    with torch.no_grad():
        logits = model(unpadded(src_row), torch.tensor([[BOS] + tokens]))[0]
    lp = torch.log_softmax(logits.double(), dim=-1)
    return float(sum(lp[i, t] for i, t in enumerate(tokens + [EOS])))


VARIANTS = {
    "post-layernorm": dict(),
    "pre-layernorm": dict(norm={"placement": "pre"}),
    "pre-scalenorm-fixnorm": dict(norm={"placement": "pre", "type": "scalenorm", "fixnorm": True}),
    "post-scalenorm": dict(norm={"placement": "post", "type": "scalenorm"}),
    "pre-rmsnorm": dict(norm={"placement": "pre", "type": "rmsnorm"}),
    "admin-omega": dict(init="admin", norm={"placement": "post"}),
    "layerdrop-drophead": dict(regularizer={"encoder_layerdrop": 0.3, "decoder_layerdrop": 0.3,
                                            "drophead": 0.2}),
    "deepnorm": dict(norm={"placement": "deepnorm"}),
    "subln": dict(norm={"placement": "subln"}),
    "sandwich-rmsnorm": dict(norm={"placement": "sandwich", "type": "rmsnorm"}),
    "rezero": dict(norm={"placement": "rezero", "type": "none"}),
    "resi_dual-layerdrop": dict(norm={"placement": "resi_dual"}, regularizer={"decoder_layerdrop": 0.3}),
    "pre-dyt": dict(norm={"placement": "pre", "type": "dyt"}),
    "reordered-rmsnorm": dict(norm={"placement": "reordered", "type": "rmsnorm"}),
    "pre_scaled-dlcl": dict(norm={"placement": "pre_scaled"}, layer_aggregation="dlcl"),
    "mix-layerdrop": dict(norm={"placement": "mix", "mix_ratio": 0.5}, regularizer={"decoder_layerdrop": 0.3}),
    "hybrid-rmsnorm-layerdrop": dict(norm={"placement": "hybrid", "type": "rmsnorm"},
                                     regularizer={"encoder_layerdrop": 0.3, "decoder_layerdrop": 0.3}),
    "hybrid-value_residual": dict(norm={"placement": "hybrid"}, value_residual=True),
    "hybrid_star-layerdrop": dict(norm={"placement": "hybrid_star"},
                                  regularizer={"encoder_layerdrop": 0.3, "decoder_layerdrop": 0.3}),
    "b2t-layerdrop": dict(norm={"placement": "b2t"}, regularizer={"encoder_layerdrop": 0.3, "decoder_layerdrop": 0.3}),
    "dlcl-pre": dict(norm={"placement": "pre"}, layer_aggregation="dlcl"),
    "dlcl-post-decoder": dict(layer_aggregation="dlcl", layer_aggregation_stacks="decoder"),
    "dwa-pre": dict(norm={"placement": "pre"}, layer_aggregation="dwa"),
    "dwa-post-decoder": dict(layer_aggregation="dwa", layer_aggregation_stacks="decoder"),
    "attnres-block-pre": dict(norm={"placement": "pre"}, layer_aggregation="attnres", attnres_block=2),
    "ngpt-layerdrop": dict(norm={"placement": "ngpt", "type": "none"}, bias=False,
                           regularizer={"encoder_layerdrop": 0.3, "decoder_layerdrop": 0.3}),
    "untied-wider-decoder": dict(decoder_d_model=24, decoder_heads=3, share_embeddings=False,
                                 learned_positions=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_equals_uncached(name):
    model = model_of(seed=1, **VARIANTS[name])
    src = source(B=6, seed=2)
    cached = beam_search(model, src, beam=4, lenpen=0.6, max_len_a=1.0, max_len_b=3)
    uncached = beam_search(model, src, beam=4, lenpen=0.6, max_len_a=1.0, max_len_b=3, incremental=False)
    assert [[h["tokens"] for h in nb] for nb in cached] == [[h["tokens"] for h in nb] for nb in uncached]
    for a, b in zip(cached, uncached):
        assert len(a) == 4
        torch.testing.assert_close(torch.tensor([h["score"] for h in a]),
                                   torch.tensor([h["score"] for h in b]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_scores_are_the_length_penalised_log_probability(name):
    model = model_of(seed=3, **VARIANTS[name])
    src = source(B=4, seed=4)
    alpha = 0.6
    for row, nbest in zip(src, beam_search(model, src, beam=3, lenpen=alpha, max_len_b=4)):
        for h in nbest:
            ref = sequence_logprob(model, row, h["tokens"])
            assert h["logprob"] == pytest.approx(ref, abs=1e-4)
            # |Y| counts EOS: len(tokens) + 1
            assert h["score"] == pytest.approx(ref / ((5 + len(h["tokens"]) + 1) / 6) ** alpha, abs=1e-4)


def test_length_penalty_values():
    assert float(length_penalty(1, 0.6)) == pytest.approx(1.0)  # ((5+1)/6)^α = 1
    assert float(length_penalty(7, 1.0)) == pytest.approx(2.0)
    assert float(length_penalty(10, 0.6)) == pytest.approx(2.5 ** 0.6)
    assert float(length_penalty(25, 2.0)) == pytest.approx(25.0)
    assert float(length_penalty(42, 0.0)) == pytest.approx(1.0)


@pytest.mark.parametrize("alpha,min_len", [(0.0, 0), (0.6, 0), (1.0, 1), (2.0, 0), (-0.5, 2)])
def test_beam_as_wide_as_the_search_space_finds_the_best_hypothesis(alpha, min_len):
    # Vocabulary: PAD, BOS, EOS + 3 real tokens; at most 3 tokens -> 1 + 3 + 9 + 27 = 40 outputs.
    V, L = 6, 3
    model = model_of(seed=5, V=V)
    src = source(B=3, S=4, V=V, seed=6)
    found = beam_search(model, src, beam=64, lenpen=alpha, max_len_a=0.0, max_len_b=L, min_len=min_len)
    for row, nbest in zip(src, found):
        every = [list(y) for n in range(min_len, L + 1) for y in itertools.product(range(3, V), repeat=n)]
        ref = sorted(((sequence_logprob(model, row, y) / ((5 + len(y) + 1) / 6) ** alpha, y) for y in every),
                     key=lambda s: -s[0])
        assert nbest[0]["tokens"] == ref[0][1]
        assert nbest[0]["score"] == pytest.approx(ref[0][0], abs=1e-4)
        # nothing pruned: the n-best list is the whole search space, in the same order
        assert [h["tokens"] for h in nbest] == [y for _, y in ref]


def test_length_penalty_changes_the_winner():
    # Not vacuous: with these weights, the exhaustive winner's length depends on α.
    V, L = 6, 3
    model = model_of(seed=5, V=V)
    src = source(B=3, S=4, V=V, seed=6)
    short = beam_search(model, src, beam=64, lenpen=-2.0, max_len_a=0.0, max_len_b=L)
    long = beam_search(model, src, beam=64, lenpen=4.0, max_len_a=0.0, max_len_b=L)
    assert [len(nb[0]["tokens"]) for nb in short] != [len(nb[0]["tokens"]) for nb in long]


def test_beam_one_equals_greedy():
    model = model_of(seed=7)
    src = source(B=8, seed=8)
    for kw in (dict(max_len_a=1.0, max_len_b=4), dict(max_len_a=0.0, max_len_b=5, min_len=3)):
        beams = [nb[0]["tokens"] for nb in beam_search(model, src, beam=1, **kw)]
        assert beams == greedy_decode(model, src, **kw)
    assert make_decoder(beam=1)(model, src) == greedy_decode(model, src)


def test_max_len_respected():
    model = model_of(seed=9)
    src = source(B=8, seed=10)
    n_src = src.ne(PAD).sum(1).tolist()
    for a, b in ((0.0, 2), (1.0, 0), (0.5, 1)):
        out = beam_search(model, src, beam=4, lenpen=1.0, max_len_a=a, max_len_b=b)
        limits = [max(int(n * a + b), 1) for n in n_src]
        assert all(len(h["tokens"]) <= lim for nb, lim in zip(out, limits) for h in nb)
        assert any(len(h["tokens"]) == lim for nb, lim in zip(out, limits) for h in nb)  # limit reached
    # capped by the positions: max_positions - 1 tokens, the last position scores the EOS
    short = model_of(seed=9, max_positions=5)
    out = beam_search(short, src[:, :4].clone(), beam=3, lenpen=1.0, max_len_b=50)
    assert max(len(h["tokens"]) for nb in out for h in nb) == 4


def test_min_len():
    model = model_of(seed=11)
    out = beam_search(model, source(B=6, seed=12), beam=4, max_len_a=0.0, max_len_b=6, min_len=4)
    assert all(4 <= len(h["tokens"]) <= 6 for nb in out for h in nb)


def test_nbest_sorted_distinct_and_clean():
    model = model_of(seed=13)
    out = beam_search(model, source(B=6, seed=14), beam=5, lenpen=0.6, max_len_b=5, nbest=5)
    for nb in out:
        scores = [h["score"] for h in nb]
        assert len(nb) == 5 and scores == sorted(scores, reverse=True)
        assert len({tuple(h["tokens"]) for h in nb}) == 5
        assert all(t not in (PAD, BOS, EOS) for h in nb for t in h["tokens"])
    top2 = beam_search(model, source(B=6, seed=14), beam=5, lenpen=0.6, max_len_b=5, nbest=2)
    assert [nb[:2] for nb in out] == top2
    with pytest.raises(ValueError, match="nbest"):
        beam_search(model, source(), beam=2, nbest=3)


def test_batch_equals_one_sentence_at_a_time():
    # Padding and sentences that finish at different steps do not change any hypothesis.
    model = model_of(seed=15)
    src = source(B=8, seed=16)
    batched = beam_search(model, src, beam=4, lenpen=0.6, max_len_b=6)
    lengths = {len(nb[0]["tokens"]) for nb in batched}
    assert len(lengths) > 1, "vacuous: every sentence has the same length"
    for row, nb in zip(src, batched):
        alone = beam_search(model, unpadded(row), beam=4, lenpen=0.6, max_len_b=6)[0]
        assert [h["tokens"] for h in alone] == [h["tokens"] for h in nb]
        assert [h["score"] for h in alone] == pytest.approx([h["score"] for h in nb], abs=1e-5)


def test_beam_search_restores_training_mode_and_make_decoder_uses_it():
    model = model_of(seed=17).train()
    src = source(B=4, seed=18)
    tokens = make_decoder(beam=3, lenpen=0.6, max_len_b=4)(model, src)
    assert model.training
    assert tokens == [nb[0]["tokens"] for nb in beam_search(model, src, beam=3, lenpen=0.6, max_len_b=4)]
    assert not math.isnan(beam_search(model, src, beam=2)[0][0]["score"])


def test_pruned_layerdrop_model():
    # LayerDrop-trained, then pruned to every other layer (Fan et al. 2019): the cache follows the
    # kept layers only, and the result is the same as the unpruned model with those layers skipped.
    from normlab.regularizers.pruning import every_other, prune

    model = model_of(seed=19, encoder_layers=4, decoder_layers=4,
                     regularizer={"encoder_layerdrop": 0.5, "decoder_layerdrop": 0.5})
    small = prune(model, every_other(4, 2), every_other(4, 2))
    assert len(small.decoder.layers) == 2
    src = source(B=6, seed=20)
    cached = beam_search(small, src, beam=4, max_len_b=4, min_len=2)
    uncached = beam_search(small, src, beam=4, max_len_b=4, min_len=2, incremental=False)
    assert [[h["tokens"] for h in nb] for nb in cached] == [[h["tokens"] for h in nb] for nb in uncached]
    for row, nb in zip(src, cached):
        assert nb[0]["logprob"] == pytest.approx(sequence_logprob(small, row, nb[0]["tokens"]), abs=1e-4)
    full = beam_search(model, src, beam=4, max_len_b=4, min_len=2)
    assert [nb[0]["score"] for nb in full] != pytest.approx([nb[0]["score"] for nb in cached])  # pruned != full
