import pytest
import torch

from normlab.config import ModelConfig
from normlab.decoding.greedy import greedy_decode
from normlab.model.transformer import Seq2SeqTransformer

V, PAD, BOS, EOS = 11, 0, 1, 2


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_heads=2,
                decoder_heads=4, encoder_ffn=24, decoder_ffn=24, max_positions=64)
    return ModelConfig(**{**base, **kw})


def source(B=8, S=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (B, S), generator=g)
    for row in range(1, B, 2):
        src[row, S - 1 - row % S:] = PAD
    return src


VARIANTS = [
    dict(),
    dict(norm={"placement": "pre", "type": "scalenorm", "fixnorm": True}),
    dict(decoder_d_model=24, decoder_heads=3, share_embeddings=False, learned_positions=True),
]
HYBRID = [dict(norm={"placement": placement}, decoder_d_model=24, decoder_heads=3, share_embeddings=False)
          for placement in ("hybrid", "hybrid_star")]  # QKV-norm; HybridNorm*'s pre-norm first layer


@pytest.mark.parametrize("kw", VARIANTS + HYBRID)
def test_step_by_step_cached_decode_equals_full_decode(kw):
    torch.manual_seed(0)
    model = Seq2SeqTransformer(tiny(**kw)).eval()
    src = source()
    tgt = torch.randint(3, V, (8, 7))
    tgt[:, 0] = BOS
    memory, pad = model.encode(src)
    full = model.decode(tgt, memory, pad)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t: t + 1], memory, pad, cache) for t in range(7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 7
    # a multi-token chunk after a cached prefix needs the bottom-right causal mask
    cache = model.new_cache()
    head = model.decode(tgt[:, :3], memory, pad, cache)
    tail = model.decode(tgt[:, 3:], memory, pad, cache)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_reorder_follows_the_batch():
    torch.manual_seed(1)
    model = Seq2SeqTransformer(tiny()).eval()
    src = source()
    tgt = torch.randint(3, V, (8, 5))
    memory, pad = model.encode(src)
    cache = model.new_cache()
    model.decode(tgt[:, :2], memory, pad, cache)
    order = torch.tensor([5, 5, 0, 7])  # beam search repeats and drops rows
    cache.reorder(order, sources=order)
    rest = model.decode(tgt[order, 2:], memory[order], pad[order], cache)
    full = model.decode(tgt[order], memory[order], pad[order])
    torch.testing.assert_close(rest, full[:, 2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", VARIANTS[::2] + HYBRID)
def test_hypotheses_share_the_memory_row_of_their_source(kw):
    # Beam search keeps memory and cross-attention keys/values once per sentence; G hypotheses per
    # sentence must decode exactly as with the memory repeated G times.
    torch.manual_seed(3)
    model = Seq2SeqTransformer(tiny(**kw)).eval()
    memory, pad = model.encode(source(B=4))
    G = 3
    tgt = torch.randint(3, V, (4 * G, 5))
    repeated = model.decode(tgt, memory.repeat_interleave(G, 0), pad.repeat_interleave(G, 0))
    torch.testing.assert_close(model.decode(tgt, memory, pad), repeated, atol=1e-5, rtol=1e-5)
    # Cached, with beams reordered within their sentences: no cross-attention state is copied.
    cache = model.new_cache()
    model.decode(tgt[:, :2], memory, pad, cache)
    cross = {id(v) for state in cache._sources.values() for v in state.values()}
    order = torch.tensor([2, 2, 0, 3, 5, 4, 6, 6, 6, 11, 9, 10])  # rows s·G + beam stay in sentence s
    cache.reorder(order)
    assert {id(v) for state in cache._sources.values() for v in state.values()} == cross
    rest = model.decode(tgt[order, 2:], memory, pad, cache)
    torch.testing.assert_close(rest, model.decode(tgt[order], memory, pad)[:, 2:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot share"):
        model.decode(tgt[:5], memory, pad)


def naive_greedy(model, src, max_len_a, max_len_b, min_len):
    # Reference: one sentence at a time, the whole prefix re-decoded at every step, no cache.
    results = []
    with torch.no_grad():
        for row in src:
            row = row[row.ne(PAD)][None]
            limit = min(int(row.size(1) * max_len_a + max_len_b), model.cfg.max_positions - 1)
            prefix = [BOS]
            while len(prefix) - 1 < limit:
                logits = model(row, torch.tensor([prefix]))[0, -1]
                logits[[PAD, BOS]] = float("-inf")
                if len(prefix) - 1 < min_len:
                    logits[EOS] = float("-inf")
                token = int(logits.argmax())
                if token == EOS:
                    break
                prefix.append(token)
            results.append(prefix[1:])
    return results


@pytest.mark.parametrize("kw", VARIANTS[:2] + HYBRID)
def test_greedy_equals_uncached_reference(kw):
    torch.manual_seed(2)
    model = Seq2SeqTransformer(tiny(**kw)).train()
    src = source(B=16, S=6, seed=3)
    hyps = greedy_decode(model, src, max_len_a=1.0, max_len_b=4)
    assert model.training  # mode restored
    assert hyps == naive_greedy(model.eval(), src, 1.0, 4, 0)
    lengths = {len(h) for h in hyps}
    assert len(lengths) > 1, "reference test is vacuous: every sentence ran to the same length"
    assert all(tok not in (PAD, BOS, EOS) for h in hyps for tok in h)


def test_greedy_min_len_and_max_len():
    torch.manual_seed(4)
    model = Seq2SeqTransformer(tiny()).eval()
    src = source(B=16, S=6, seed=3)
    hyps = greedy_decode(model, src, max_len_a=0.0, max_len_b=3, min_len=2)
    assert hyps == naive_greedy(model, src, 0.0, 3, 2)
    assert all(2 <= len(h) <= 3 for h in hyps)
    assert all(len(h) <= 2 for h in greedy_decode(model, src, max_len_a=0.0, max_len_b=2))
