"""Attention Residuals (Kimi Team 2026, arXiv 2603.15031), model.layer_aggregation=attnres: the stack
against a plain float64 computation of h_l = Σ_i softmax_i(w_lᵀ·RMSNorm(v_i))·v_i with hand-set
pseudo-queries, full and block forms, the uniform average at init, S = 1 is full AttnRes, cached
decoding equals full, pruning keeps the kept layers' queries, the refusals, and the arm's name."""
import pytest
import torch

from normlab.config import ConfigError
from normlab.model.transformer import Seq2SeqTransformer
from normlab.regularizers.pruning import prune

from conftest import cached_and_full
from test_arms import PAD, batch, tiny


def built(seed=0, **kw) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    return Seq2SeqTransformer(tiny(**kw)).eval().double()


def reference(model, src, queries, block):
    # The paper's formula written out for the encoder, in float64, with the layers run one by one.
    eps = model.cfg.norm.eps
    pad, layers = src.eq(PAD), model.encoder.layers

    def attend(w, sources):
        logits = torch.stack([(v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)) @ w for v in sources])
        a = torch.softmax(logits, dim=0)
        return sum(a[i].unsqueeze(-1) * v for i, v in enumerate(sources))

    outputs, h = [], None
    x0 = model.encoder.embed(src)
    for i in range(len(layers)):
        # sources: v_0, every finished block's sum, the sum of this block's earlier layers
        start = (i // block) * block
        finished = [sum(outputs[b:b + block]) for b in range(0, start, block)]
        current = [sum(outputs[start:i])] if i > start else []
        h = attend(queries[i], [x0] + finished + current)
        outputs.append(layers[i](h, pad) - h)
    n = len(layers)
    start = (n // block) * block if n % block else n
    finished = [sum(outputs[b:b + block]) for b in range(0, start, block)]
    rest = [sum(outputs[start:])] if start < n else []
    return model.encoder.final_norm(attend(queries[n], [x0] + finished + rest))


@pytest.mark.parametrize("block, layers", [(1, 3), (2, 5), (3, 4), (8, 3)])
def test_attnres_stack_is_the_papers_formula(block, layers):
    model = built(norm={"placement": "pre"}, encoder_layers=layers, layer_aggregation="attnres",
                  layer_aggregation_stacks="encoder", attnres_block=block)
    queries = torch.randn(layers + 1, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        model.encoder.aggregation.query.copy_(queries)
    src, _ = batch()
    torch.testing.assert_close(model.encode(src)[0], reference(model, src, queries, block), rtol=1e-12, atol=1e-12)


def test_at_init_each_layer_reads_the_uniform_average_of_its_sources():
    model = built(norm={"placement": "pre"}, layer_aggregation="attnres", layer_aggregation_stacks="encoder")
    assert model.encoder.aggregation.query.detach().eq(0).all()  # the authors' init: w_l = 0
    assert type(model.decoder.aggregation).__name__ == "LayerChain"
    src, _ = batch()
    pad, layers = src.eq(PAD), model.encoder.layers
    x0 = model.encoder.embed(src)
    v1 = layers[0](x0, pad) - x0  # layer 1 reads v_0 alone
    h2 = (x0 + v1) / 2
    v2 = layers[1](h2, pad) - h2
    h3 = (x0 + v1 + v2) / 3
    v3 = layers[2](h3, pad) - h3
    out = model.encoder.final_norm((x0 + v1 + v2 + v3) / 4)
    torch.testing.assert_close(model.encode(src)[0], out, rtol=1e-12, atol=1e-12)


def test_one_block_over_the_stack_reads_half_the_standard_residual_stream_at_init():
    # S ≥ L: the sources are v_0 and the partial sum of the layers so far, the standard residual's
    # two parts; with w = 0 each layer reads their average, (v_0 + Σ_{j<l} v_j)/2 = h_l/2.
    model = built(norm={"placement": "pre"}, layer_aggregation="attnres", layer_aggregation_stacks="encoder",
                  attnres_block=8)
    src, _ = batch()
    pad, layers = src.eq(PAD), model.encoder.layers
    stream = model.encoder.embed(src)  # the standard pre-norm stream h_l = v_0 + Σ v_j
    h = stream
    for i in range(3):
        h = stream / 2 if i else stream  # layer 1 has one source, v_0
        stream = stream + (layers[i](h, pad) - h)
    torch.testing.assert_close(model.encode(src)[0], model.encoder.final_norm(stream / 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block", [1, 2])
def test_attnres_on_the_decoder_cached_equals_uncached(block):
    model = built(norm={"placement": "pre"}, decoder_layers=3, layer_aggregation="attnres", attnres_block=block)
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):
            stack.aggregation.query.normal_(generator=torch.Generator().manual_seed(3))
    steps, full = cached_and_full(model, *batch(1))
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)


def test_every_query_but_the_first_layers_learns():
    # layer 1 has one source (v_0): a softmax over one is 1 whatever w_1 is
    model = built(norm={"placement": "pre"}, layer_aggregation="attnres").train()
    with torch.no_grad():
        model.encoder.aggregation.query.normal_(generator=torch.Generator().manual_seed(3))
    src, tgt = batch()
    model(src, tgt).logsumexp(-1).mean().backward()
    for stack in (model.encoder, model.decoder):
        grad = stack.aggregation.query.grad.abs().sum(-1)
        assert grad[0] == 0 and grad[1:].gt(0).all()


def test_pruning_keeps_the_kept_layers_queries_and_equals_skipping(tmp_path):
    from normlab.checkpoint import load_model, save_model

    model = built(norm={"placement": "pre"}, encoder_layers=4, layer_aggregation="attnres",
                  layer_aggregation_stacks="encoder")
    queries = torch.randn(5, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        model.encoder.aggregation.query.copy_(queries)
    pruned = prune(model, [0, 2], [0, 1])
    assert torch.equal(pruned.encoder.aggregation.query, queries[[0, 2, 4]])
    src, tgt = batch(2)
    skipped = torch.nn.ModuleList([model.encoder.layers[0], model.encoder.layers[2]])
    x = model.encoder.aggregation.subset([0, 2])(skipped, model.encoder.embed(src), src.eq(PAD))
    torch.testing.assert_close(pruned.encode(src)[0], model.encoder.final_norm(x))
    loaded, _ = load_model(save_model(tmp_path / "p.ckpt", pruned.float(), tokenizer_proto=None))
    assert torch.equal(loaded(src, tgt), pruned.float()(src, tgt))


@pytest.mark.parametrize("kw, message", [
    (dict(layer_aggregation="attnres", norm={"placement": "post"}),
     r"^model\.layer_aggregation: attnres with norm\.placement=post: Attention Residuals replace"),
    (dict(layer_aggregation="attnres", norm={"placement": "mix", "mix_ratio": 0.5}),
     r"^model\.layer_aggregation: attnres with norm\.placement=mix: "),
    (dict(layer_aggregation="dwa", attnres_block=2),
     r"^model\.attnres_block: 2 with model\.layer_aggregation=dwa: only attnres reads it; leave it at 1$"),
    (dict(attnres_block=2), r"^model\.attnres_block: 2 with model\.layer_aggregation=none: only attnres"),
    (dict(layer_aggregation="attnres", attnres_block=0), r"^model\.attnres_block: 0 is not valid"),
    (dict(layer_aggregation="attnres", norm={"placement": "pre"}, regularizer={"encoder_layerdrop": 0.1}),
     r"^regularizer\.encoder_layerdrop: 0\.1 with model\.layer_aggregation=attnres on the encoder"),
    (dict(layer_aggregation="attnres", residual="hyper", norm={"placement": "pre"}),
     r"^model\.residual: hyper with model\.layer_aggregation=attnres: both learn how layers mix"),
])
def test_attnres_refuses_what_it_cannot_take(kw, message):
    with pytest.raises(ConfigError, match=message):
        tiny(**kw)


@pytest.mark.parametrize("placement", ["pre", "subln", "sandwich", "reordered", "pre_scaled"])
def test_attnres_takes_every_pre_norm_placement(placement):
    tiny(layer_aggregation="attnres", attnres_block=2, norm={"placement": placement})


def test_the_arm_names_the_run_attnres_pre():
    from normlab import identity

    from conftest import compose_cfg

    labels = identity.labels(compose_cfg(["logger=csv", "+arm=attnres_pre"]))
    assert (labels["aggregation"], labels["arm"]) == ("attnres", "attnres_pre")
    block = identity.labels(compose_cfg(["logger=csv", "+arm=attnres_pre", "model.attnres_block=4"]))
    assert (block["aggregation"], block["arm"]) == ("attnres4", "attnres4_pre")
