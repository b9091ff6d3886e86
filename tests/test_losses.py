import pytest
import torch
import torch.nn.functional as F

from normlab.losses import label_smoothed_nll

PAD = 0


def _data(seed=0, B=3, T=5, V=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    target = torch.randint(1, V, (B, T), generator=g)
    target[0, 3:] = PAD  # padding must never count
    target[2, 1:] = PAD
    return logits, target


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_uniform_matches_torch_cross_entropy(eps):
    logits, target = _data()
    loss, nll = label_smoothed_nll(logits, target, eps, PAD, "uniform")
    ref = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=PAD,
                          label_smoothing=eps, reduction="sum")
    ref_nll = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss.double(), ref)
    torch.testing.assert_close(nll.double(), ref_nll)


def test_fairseq_convention_matches_explicit_distribution():
    logits, target = _data(1)
    eps, V = 0.1, logits.size(-1)
    loss, _ = label_smoothed_nll(logits, target, eps, PAD, "fairseq")
    # q = 1 - eps on the gold class, eps / (V - 1) on each other class (fairseq).
    q = torch.full(logits.shape, eps / (V - 1), dtype=torch.float64)
    q.scatter_(-1, target.unsqueeze(-1), 1 - eps)
    ce = -(q * F.log_softmax(logits, -1)).sum(-1)
    ref = ce[target.ne(PAD)].sum()
    torch.testing.assert_close(loss.double(), ref)


def test_pad_tokens_do_not_count():
    logits, target = _data(2)
    loss, _ = label_smoothed_nll(logits, target, 0.1, PAD)
    logits2 = logits.clone()
    logits2[target.eq(PAD)] = torch.randn_like(logits2[target.eq(PAD)]) * 100
    loss2, _ = label_smoothed_nll(logits2, target, 0.1, PAD)
    torch.testing.assert_close(loss, loss2)


def test_unknown_convention_is_rejected():
    logits, target = _data()
    with pytest.raises(ValueError, match="convention"):
        label_smoothed_nll(logits, target, 0.1, PAD, "bogus")


def _reference(logits, target, eps, convention):
    # The loss written out as the explicit smoothed distribution q, autograd doing the rest.
    V = logits.size(-1)
    off = eps / V if convention == "uniform" else eps / (V - 1)
    gold = 1 - eps + off if convention == "uniform" else 1 - eps
    q = torch.full(logits.shape, off, dtype=logits.dtype).scatter_(-1, target.unsqueeze(-1), gold)
    lp = F.log_softmax(logits, -1)
    keep = target.ne(PAD)
    return -(q * lp).sum(-1)[keep].sum(), -lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)[keep].sum()


@pytest.mark.parametrize("convention", ["uniform", "fairseq"])
def test_gradient_equals_autograd_of_the_explicit_distribution(convention):
    logits, target = _data(3)
    for weights in [(1.0, 0.0), (0.0, 1.0), (0.7, -0.3)]:  # through the loss, the nll, and both
        ours_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        ours, ref = label_smoothed_nll(ours_in, target, 0.2, PAD, convention), _reference(ref_in, target, 0.2, convention)
        (weights[0] * ours[0] + weights[1] * ours[1]).backward()
        (weights[0] * ref[0] + weights[1] * ref[1]).backward()
        torch.testing.assert_close(ours_in.grad, ref_in.grad)
        assert ours_in.grad[target.eq(PAD)].abs().max() == 0  # pad rows get no gradient


def test_gradcheck_and_low_precision_logits():
    logits, target = _data(4, B=3, T=4, V=5)
    assert torch.autograd.gradcheck(lambda x: label_smoothed_nll(x, target, 0.1, PAD)[0], logits.requires_grad_())
    half = logits.detach().to(torch.bfloat16).requires_grad_()
    loss, _ = label_smoothed_nll(half, target, 0.1, PAD)
    assert loss.dtype == torch.float32  # log-probabilities in fp32 even for bf16 logits (autocast)
    loss.backward()
    assert half.grad.dtype == torch.bfloat16


def test_second_backward_through_a_retained_graph_gives_the_same_gradient():
    logits, target = _data(5)
    logits.requires_grad_()
    loss, _ = label_smoothed_nll(logits, target, 0.1, PAD)
    loss.backward(retain_graph=True)
    first = logits.grad.clone()
    loss.backward()
    torch.testing.assert_close(logits.grad, 2 * first)


@pytest.mark.parametrize("convention", ["uniform", "fairseq"])
@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])  # one row, a chunk across pad rows, all rows
def test_projected_loss_equals_the_loss_of_the_logits(convention, chunk_rows, monkeypatch):
    import normlab.losses as losses

    monkeypatch.setitem(losses.CHUNK_ELEMENTS, "cpu", chunk_rows * 11)
    _, target = _data(6)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 7, generator=g, dtype=torch.float64, requires_grad=True)
    loss, nll, _ = losses.projected_label_smoothed_nll(x, w, target, 0.2, PAD, convention)
    ref_loss, ref_nll = label_smoothed_nll(x @ w.t(), target, 0.2, PAD, convention)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    torch.testing.assert_close(torch.autograd.grad(3 * loss, (x, w)), torch.autograd.grad(3 * ref_loss, (x, w)))
    with torch.no_grad():
        torch.testing.assert_close(losses.projected_label_smoothed_nll(x, w, target, 0.2, PAD, convention)[0], loss)


@pytest.mark.parametrize("kw", [dict(), dict(norm={"placement": "pre", "type": "scalenorm", "fixnorm": True}),
                                dict(tie_output_embeddings=False)])
def test_model_loss_equals_the_loss_of_the_model_logits(kw):
    from normlab.config import ModelConfig
    from normlab.losses import model_loss
    from normlab.model.transformer import Seq2SeqTransformer

    torch.manual_seed(7)
    model = Seq2SeqTransformer(ModelConfig(vocab_size=11, d_model=8, encoder_layers=1, decoder_layers=1,
                                           encoder_ffn=16, decoder_ffn=16, encoder_heads=2, decoder_heads=2, **kw))
    _, target = _data(8)
    src = torch.randint(3, 11, (3, 4))
    tgt_in = torch.randint(3, 11, (3, 5))
    loss, nll, _ = model_loss(model, src, tgt_in, target, 0.1, PAD)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    ref, ref_nll = label_smoothed_nll(model(src, tgt_in), target, 0.1, PAD)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close((loss, nll), (ref, ref_nll))
    for a, b in zip(grads, ref_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_projected_loss_under_bf16_autocast():
    from normlab.losses import projected_label_smoothed_nll

    _, target = _data(9)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 5, 7, generator=g, requires_grad=True)
    w = torch.randn(11, 7, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = projected_label_smoothed_nll(x, w, target, 0.1, PAD)
    gx, gw = torch.autograd.grad(loss, (x, w))
    ref = label_smoothed_nll(x @ w.t(), target, 0.1, PAD)[0]
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, w))
    assert loss.dtype == torch.float32 and gx.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=0)
    torch.testing.assert_close((gx, gw), (ref_gx, ref_gw), rtol=5e-2, atol=2e-2)
