import math

import pytest
import torch
from torch import nn

from normlab.config import NormConfig
from normlab.model.initialization import xavier_init_
from normlab.model.embeddings import OutputProjection, TokenEmbedding, sinusoidal_table
from normlab.model.norms import NORMS, RMSNorm, ScaleNorm, build_norm


def test_build_norm_picks_class_and_settings():
    assert type(build_norm(NormConfig(type="layernorm", eps=1e-6), 8)) is nn.LayerNorm
    assert build_norm(NormConfig(type="layernorm", eps=1e-6), 8).eps == 1e-6
    assert isinstance(build_norm(NormConfig(type="rmsnorm"), 8), RMSNorm)
    assert build_norm(NormConfig(type="scalenorm"), 16).g.item() == pytest.approx(4.0)  # √d
    assert build_norm(NormConfig(type="scalenorm", scale_init=2.5), 16).g.item() == pytest.approx(2.5)
    assert set(NORMS) == {"layernorm", "scalenorm", "rmsnorm", "dyt", "derf", "none"}


def test_scalenorm_matches_formula_including_eps_clamp():
    norm = ScaleNorm(6, eps=1e-3)
    with torch.no_grad():
        norm.g.fill_(1.7)
    x = torch.randn(3, 4, 6)
    x[0, 0] = 0.0  # ‖x‖ = 0 -> divided by eps, not by zero
    x[0, 1] = 1e-4  # ‖x‖ < eps -> divided by eps
    expected = 1.7 * x / torch.clamp(x.norm(dim=-1, keepdim=True), min=1e-3)
    torch.testing.assert_close(norm(x), expected)
    assert torch.allclose(norm(x)[1:].norm(dim=-1), torch.full((2, 4), 1.7))
    assert torch.equal(norm(x)[0, 0], torch.zeros(6))


def test_rmsnorm_matches_formula():
    norm = RMSNorm(5, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 5))
    x = torch.randn(2, 3, 5) * 3 + 1
    rms = torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), x / rms * torch.linspace(0.5, 2.0, 5))


@pytest.mark.parametrize("cls", [ScaleNorm, RMSNorm])
def test_norm_gradients_match_finite_differences(cls):
    norm = cls(4).double()
    for p in norm.parameters():
        p.data.uniform_(0.5, 2.0)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_, *ps: torch.func.functional_call(
        norm, dict(zip([n for n, _ in norm.named_parameters()], ps)), (x_,)),
        (x, *norm.parameters()))


def test_sinusoidal_table_is_the_papers_interleaved_formula():
    d = 10
    table = sinusoidal_table(60, d)
    for pos, i in [(0, 0), (1, 0), (7, 2), (59, 4), (33, 1)]:
        angle = pos / 10000 ** (2 * i / d)
        assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert sinusoidal_table(5, 7).shape == (5, 7)  # odd width: last column is a sin


def test_fixnorm_embeddings_have_norm_sqrt_d_and_zero_pad():
    emb = xavier_init_(TokenEmbedding(20, 16, pad_id=0, fixnorm=True))  # pad row zeroed
    emb.embedding.weight.data.mul_(3.0)
    tokens = torch.tensor([[5, 7, 19, 0]])
    norms = emb(tokens).norm(dim=-1)[0]
    torch.testing.assert_close(norms[:3], torch.full((3,), 4.0))
    assert norms[3].item() == 0.0
    plain = TokenEmbedding(20, 16, pad_id=0, fixnorm=False)
    plain.embedding.weight.data.copy_(emb.embedding.weight.data)
    torch.testing.assert_close(plain(tokens), emb.embedding(tokens) * 4.0)


def test_fixnorm_output_is_g_times_cosine():
    emb = TokenEmbedding(12, 8, pad_id=0, fixnorm=True)
    out = OutputProjection(12, 8, tied=emb, fixnorm=True)
    assert out.g.item() == pytest.approx(math.sqrt(8))
    with torch.no_grad():
        out.g.fill_(3.0)
    x = torch.randn(2, 5, 8) * 10
    w = emb.weight
    cos = (x @ w.T) / (x.norm(dim=-1, keepdim=True) * w.norm(dim=-1).clamp(min=1e-12))
    torch.testing.assert_close(out(x), 3.0 * cos)
    aligned = out(w[4].expand(1, 1, 8) * 7.0)  # x parallel to w_4: cosine 1 -> logit g
    assert aligned[0, 0, 4].item() == pytest.approx(3.0)
    assert aligned.abs().max().item() <= 3.0 + 1e-5


def test_plain_tied_output_is_x_times_embedding_transpose():
    emb = TokenEmbedding(12, 8, pad_id=0)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(OutputProjection(12, 8, tied=emb)(x), x @ emb.weight.T)
