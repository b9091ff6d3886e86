"""LayerDrop limit tests (p = 0, p = 1, eval), draw synchronisation, zero gradients, learned rates."""
import math

import pytest
import torch
from torch import nn

from normlab.config import ModelConfig
from normlab.model.transformer import Seq2SeqTransformer
from normlab.regularizers.layerdrop import LayerDropModuleList
from normlab.regularizers.pruning import prune

V = 29


def cfg(ld=0.0, rates="uniform", layers=4, dropout=0.1, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=16, encoder_layers=layers, decoder_layers=layers, encoder_heads=2,
                       decoder_heads=2, encoder_ffn=24, decoder_ffn=24, max_positions=32, dropout=dropout,
                       regularizer=dict(encoder_layerdrop=ld, decoder_layerdrop=ld, layerdrop_rates=rates), **kw)


def batch(B=3, S=7, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(3, V, (B, S), generator=g), torch.randint(3, V, (B, T), generator=g)
    src[0, 5:] = 0
    return src, tgt


def model(c: ModelConfig, seed=0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    return Seq2SeqTransformer(c)


def test_p0_is_the_model_without_layerdrop_same_outputs_and_rng():
    src, tgt = batch()
    plain = model(cfg(0.0))
    assert type(plain.encoder.layers) is nn.ModuleList  # config p = 0: no LayerDrop state at all
    assert type(model(cfg(0.0, rates="learned")).decoder.layers) is nn.ModuleList  # no unused logits
    wrapped = model(cfg(0.0))
    # the list itself at p = 0: same layers, same outputs, same global RNG use (dropout is on)
    wrapped.encoder.layers = LayerDropModuleList(0.0, list(wrapped.encoder.layers))
    wrapped.decoder.layers = LayerDropModuleList(0.0, list(wrapped.decoder.layers))
    plain.train(), wrapped.train()
    torch.manual_seed(5)
    a = plain(src, tgt)
    state_a = torch.get_rng_state()
    torch.manual_seed(5)
    b = wrapped(src, tgt)
    assert torch.equal(a, b)
    assert torch.equal(state_a, torch.get_rng_state())
    assert wrapped.encoder.layers.draw_state[1] == 0  # p = 0 draws nothing


def test_layerdrop_never_touches_the_global_rng():
    m = model(cfg(0.5, dropout=0.0)).train()
    src, tgt = batch()
    torch.manual_seed(3)
    m(src, tgt)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(3).get_state())


def test_eval_uses_every_layer_is_deterministic_and_draws_nothing():
    src, tgt = batch()
    m = model(cfg(0.5)).eval()
    ref = Seq2SeqTransformer(cfg(0.0)).eval()
    missing, unexpected = ref.load_state_dict(m.state_dict(), strict=False)
    assert not missing and sorted(unexpected) == ["decoder.layers.draw_state", "encoder.layers.draw_state"]
    a, b = m(src, tgt), m(src, tgt)
    assert torch.equal(a, b) and torch.equal(a, ref(src, tgt))
    assert m.encoder.layers.draw_state[1] == 0 and m.encoder.layers.last_kept == [0, 1, 2, 3]


def test_p1_skips_every_layer():
    src, tgt = batch()
    m = model(cfg(1.0, dropout=0.0, norm=dict(placement="pre"))).train()
    memory, pad = m.encode(src)
    assert m.encoder.layers.last_kept == []
    x = m.encoder.embed(src)
    assert torch.equal(memory, m.encoder.final_norm(x))  # identity stack: embeddings + final norm
    out = m.decode(tgt, memory, pad)
    assert m.decoder.layers.last_kept == []
    assert torch.equal(out, m.output_projection(m.decoder.final_norm(m.decoder.embed(tgt))))


def test_training_forward_equals_the_kept_layers_and_skipped_layers_get_zero_gradients():
    src, tgt = batch()
    m = model(cfg(0.5, layers=6, dropout=0.0)).train()
    for _ in range(20):  # find a draw that skips something in both stacks
        m.zero_grad(set_to_none=True)
        out = m(src, tgt)
        ke, kd = m.encoder.layers.last_kept, m.decoder.layers.last_kept
        if 0 < len(ke) < 6 and 0 < len(kd) < 6:
            break
    out.square().sum().backward()
    ref = prune(m, ke, kd).eval()
    assert torch.allclose(out, ref(src, tgt), atol=1e-6)
    for i in range(6):
        grads = [p.grad for p in m.encoder.layers[i].parameters()]
        assert all(g is not None for g in grads)  # DDP needs every parameter to get a gradient
        assert all(torch.count_nonzero(g) == 0 for g in grads) == (i not in ke)


def test_draws_depend_on_seed_and_counter_only_and_resume_continues():
    def kept(m, n):
        src, tgt = batch()
        out = []
        for _ in range(n):
            m(src, tgt)
            torch.rand(1000)  # unrelated global-RNG use must not change the draws
            out.append((tuple(m.encoder.layers.last_kept), tuple(m.decoder.layers.last_kept)))
        return out

    a = model(cfg(0.5, dropout=0.0), seed=0).train()
    b = model(cfg(0.5, dropout=0.3), seed=0).train()  # dropout consumes global RNG differently
    seq_a = kept(a, 10)
    assert seq_a == kept(b, 10)
    assert len(set(seq_a)) > 1 and any(e != d for e, d in seq_a)  # encoder and decoder differ
    c = model(cfg(0.5, dropout=0.0), seed=0).train()
    kept(c, 4)
    resumed = model(cfg(0.5, dropout=0.0), seed=7).train()  # another seed, then the checkpoint
    resumed.load_state_dict(c.state_dict())
    assert kept(resumed, 6) == seq_a[4:]


def test_drop_frequency_is_p():
    layers = LayerDropModuleList(0.3, [nn.Identity() for _ in range(10)], seed=1).train()
    n, dropped = 400, 0
    for _ in range(n):
        list(layers)
        dropped += 10 - len(layers.last_kept)
    total = 10 * n
    assert abs(dropped / total - 0.3) < 4 * math.sqrt(0.3 * 0.7 / total)


def test_slicing_and_repr_do_not_draw():
    layers = LayerDropModuleList(0.5, [nn.Linear(2, 2) for _ in range(4)]).train()
    repr(layers)
    sub = layers[1:3]
    assert isinstance(sub, LayerDropModuleList) and len(sub) == 2 and sub[0] is layers[1]
    assert layers.draw_state[1] == 0


def test_learned_rates_keep_mean_p_and_get_gradients():
    m = model(cfg(0.4, rates="learned", layers=5, dropout=0.0)).train()
    layers = m.encoder.layers
    assert torch.allclose(layers.drop_rates(), torch.full((5,), 0.4))
    with torch.no_grad():
        layers.rate_logits.copy_(torch.tensor([0.5, -1.0, 0.2, 0.0, 0.3]))
    assert math.isclose(layers.drop_rates().mean().item(), 0.4, rel_tol=1e-6)
    src, tgt = batch()
    for _ in range(50):  # a draw that drops some but not all layers of both stacks
        m.zero_grad(set_to_none=True)
        out = m(src, tgt)
        ke, kd = layers.last_kept, m.decoder.layers.last_kept
        if 0 < len(ke) < 5 and 0 < len(kd) < 5:
            break
    assert 0 < len(ke) < 5 and 0 < len(kd) < 5
    out.square().mean().backward()
    assert layers.rate_logits.grad is not None and layers.rate_logits.grad.abs().sum() > 0
    # the forward value is exactly the hard gate: the kept layers only
    assert torch.allclose(out, prune(m, ke, kd).eval()(src, tgt), atol=1e-5)


def test_every_parameter_gets_a_gradient_even_when_every_layer_is_skipped():
    # p = 1: the decoder uses the encoder output only through its skipped layers' zero term
    m = model(cfg(1.0, dropout=0.0)).train()
    src, tgt = batch()
    m(src, tgt).square().mean().backward()
    assert m.decoder.layers.last_kept == [] and m.encoder.layers.last_kept == []
    assert all(p.grad is not None for p in m.parameters())
