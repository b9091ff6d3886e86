"""DenseFormer's depth-weighted average (Pagliardini et al. 2024), model.layer_aggregation=dwa: the
stack against the formula with hand-set α, the identity at init (the same model without
aggregation, bit for bit), pruning == skipping the layers (the combinations it refuses: test_arms.py)."""
import pytest
import torch

from normlab.config import ConfigError
from normlab.model.transformer import Seq2SeqTransformer
from normlab.regularizers.pruning import prune

from conftest import cached_and_full
from test_arms import PAD, batch, tiny


def built(seed=0, **kw) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    return Seq2SeqTransformer(tiny(**kw)).eval()


def test_weights_start_as_the_identity():
    model = built(layer_aggregation="dwa", layer_aggregation_stacks="decoder")
    assert type(model.encoder.aggregation).__name__ == "LayerChain"
    alpha = model.decoder.aggregation.weight.detach()
    # the authors' init: α_{i,i} = 1 (after layer i, on its own output), every other α 0
    assert torch.equal(alpha, torch.tensor([[0., 1., 0.], [0., 0., 1.]]))


@pytest.mark.parametrize("placement, stacks", [("pre", "both"), ("post", "encoder"), ("deepnorm", "decoder"),
                                               ("sandwich", "both"), ("mix", "both"), ("hybrid", "both"),
                                               ("hybrid_star", "decoder")])
def test_an_untrained_dwa_model_is_the_model_without_aggregation(placement, stacks):
    kw = dict(norm={"placement": placement, **({"mix_ratio": 0.5} if placement == "mix" else {})})
    plain = built(**kw)
    dwa = built(layer_aggregation="dwa", layer_aggregation_stacks=stacks, **kw)
    missing = dwa.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing and all(k.endswith("aggregation.weight") for k in missing)  # DWA adds only α
    src, tgt = batch()
    assert torch.equal(dwa(src, tgt), plain(src, tgt))
    cache_dwa, cache_plain = dwa.new_cache(), plain.new_cache()
    memory, pad = plain.encode(src)
    for t in range(tgt.size(1)):  # incremental decoding too
        step = tgt[:, t:t + 1]
        assert torch.equal(dwa.decode(step, memory, pad, cache_dwa), plain.decode(step, memory, pad, cache_plain))


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_dwa_stack_is_the_papers_depth_weighted_average(placement):
    model = built(norm={"placement": placement}, layer_aggregation="dwa", layer_aggregation_stacks="encoder")
    alpha = torch.tensor([[0.3, 0.9, 0.0, 0.0],  # after layer 1: 0.3·x_0 + 0.9·y_1
                          [-0.2, 0.5, 1.1, 0.0],  # after layer 2
                          [0.1, 0.0, -0.4, 0.7]])  # after layer 3: the stack output (x_2 left out)
    with torch.no_grad():
        model.encoder.aggregation.weight.copy_(alpha + torch.triu(torch.full((3, 4), 9.0), diagonal=2))
    src, _ = batch()
    pad, layers = src.eq(PAD), model.encoder.layers
    x0 = model.encoder.embed(src)
    y1 = layers[0](x0, pad)
    x1 = 0.3 * x0 + 0.9 * y1
    y2 = layers[1](x1, pad)
    x2 = -0.2 * x0 + 0.5 * y1 + 1.1 * y2
    y3 = layers[2](x2, pad)
    x3 = 0.1 * x0 - 0.4 * y2 + 0.7 * y3  # the upper triangle (9s) is never read
    torch.testing.assert_close(model.encode(src)[0], model.encoder.final_norm(x3))


def test_dwa_on_the_decoder_is_per_position_cached_equals_uncached():
    model = built(norm={"placement": "pre"}, layer_aggregation="dwa", layer_aggregation_stacks="decoder")
    with torch.no_grad():
        model.decoder.aggregation.weight.add_(torch.rand(2, 3, generator=torch.Generator().manual_seed(3)))
    steps, full = cached_and_full(model, *batch(1))
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


def test_only_the_lower_triangle_learns():
    model = built(layer_aggregation="dwa").train()
    src, tgt = batch()
    model(src, tgt).logsumexp(-1).mean().backward()
    g = model.encoder.aggregation.weight.grad
    assert g.tril(diagonal=1).abs().sum() > 0 and g.triu(diagonal=2).eq(0).all()


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_pruning_a_dwa_stack_equals_skipping_the_layers(placement, tmp_path):
    # Skipping a layer of a DWA stack = leaving its output out of every average and its own average
    # out of the stack: the pruned DWA holds α's rows of the kept layers and columns of x_0 and theirs.
    from normlab.checkpoint import load_model, save_model

    model = built(norm={"placement": placement}, encoder_layers=5, layer_aggregation="dwa")
    with torch.no_grad():
        model.encoder.aggregation.weight.add_(torch.rand(5, 6, generator=torch.Generator().manual_seed(4)))
    keep = [0, 2, 3]
    pruned = prune(model, keep, [1])
    alpha = model.encoder.aggregation.weight.detach()
    assert torch.equal(pruned.encoder.aggregation.weight, alpha[[0, 2, 3]][:, [0, 1, 3, 4]])
    assert alpha.shape == (5, 6)  # the original is untouched
    src, tgt = batch(2)
    pad = src.eq(PAD)
    history, x = [model.encoder.embed(src)], model.encoder.embed(src)
    cols = [0]
    for k in keep:  # the original stack, layers 1 and 4 skipped
        history.append(model.encoder.layers[k](x, pad))
        cols.append(k + 1)
        x = sum(alpha[k, c] * h for c, h in zip(cols, history))
    torch.testing.assert_close(pruned.encode(src)[0], model.encoder.final_norm(x))
    loaded, _ = load_model(save_model(tmp_path / "p.ckpt", pruned, tokenizer_proto=None))
    assert torch.equal(loaded(src, tgt), pruned(src, tgt))


def test_a_pruned_untrained_dwa_model_is_the_pruned_model_without_aggregation():
    plain = built(encoder_layers=4)
    dwa = built(encoder_layers=4, layer_aggregation="dwa")
    dwa.load_state_dict(plain.state_dict(), strict=False)
    src, tgt = batch()
    assert torch.equal(prune(dwa, [1, 3], [0])(src, tgt), prune(plain, [1, 3], [0])(src, tgt))


def test_the_arm_names_the_run_dwa_pre():
    from normlab import identity

    from conftest import compose_cfg

    labels = identity.labels(compose_cfg(["logger=csv", "+arm=dwa_pre"]))
    assert (labels["norm"], labels["aggregation"], labels["arm"]) == ("pre_ln", "dwa", "dwa_pre")
    enc = identity.labels(compose_cfg(["logger=csv", "+arm=dwa_pre", "model.layer_aggregation_stacks=encoder"]))
    assert enc["arm"] == "dwa_encoder_pre"


def test_admin_profiles_a_dwa_model_as_the_model_without_aggregation():
    # Admin's profile (Liu et al. 2020) runs before step 1, where DWA is the identity: each sub-layer
    # reads the previous one's output, as Admin assumes, so the ω are the plain post-norm model's.
    from normlab.init.admin import omega_values, profile_omega_

    plain = built(norm={"placement": "post"}, init="admin")
    dwa = built(norm={"placement": "post"}, init="admin", layer_aggregation="dwa")
    dwa.load_state_dict(plain.state_dict(), strict=False)
    src, tgt = batch()
    for model in (plain, dwa):
        profile_omega_(model, [{"src": src, "tgt_in": tgt}], PAD)
    assert omega_values(dwa) == omega_values(plain) and len(omega_values(plain)) > 1


@pytest.mark.parametrize("aggregation", ["dwa", "dlcl"])
def test_the_weighted_history_keeps_the_fp32_stream_under_bf16_autocast(aggregation):
    """A contraction (tensordot: a matmul) ran in bf16 under autocast, rounding the residual stream
    after every layer; the elementwise sum keeps fp32 (review finding). At init DWA is still the plain
    model bit for bit under autocast."""
    plain = built()
    agg = built(layer_aggregation=aggregation)
    if aggregation == "dwa":
        agg.load_state_dict(plain.state_dict(), strict=False)
    src, tgt = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        memory, _ = agg.encode(src)
        assert memory.dtype == torch.float32
        history = [torch.randn(2, 3, 8) for _ in range(3)]
        from normlab.model.aggregation import weighted_sum

        assert weighted_sum(torch.tensor([0.2, 0.3, 0.5]), history).dtype == torch.float32
        if aggregation == "dwa":
            assert torch.equal(agg(src, tgt), plain(src, tgt))
