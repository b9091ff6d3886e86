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
