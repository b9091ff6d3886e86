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
