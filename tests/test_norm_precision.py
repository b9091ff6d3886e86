"""The last two normalisations in fp16 and bf16 (issue 20; tests/test_qk_norm_precision.py has the
others): mHC's dynamic RMS over the flattened streams (Xie et al. 2025, model.residual=mhc with
residual_mixing=dynamic) and FixNorm's ℓ2 normalisations (Nguyen & Salazar 2019, norm.fixnorm). Each
computes in fp32 and rounds once to its input's dtype (norms.widened): in fp32 the formula it had (to
fp32 rounding where the op order changed since, bit for bit where it did not), in fp16 / bf16 within eps/2 of that fp32 value, where in fp16 a square past 65504 (|x| ≥ 256)
overflowed and F.normalize's ε = 1e-12 is 0 (a zero row gave 0/0)."""
import copy

import pytest
import torch

from normlab.model.embeddings import OutputProjection, TokenEmbedding
from normlab.model.hyper import ManifoldHyperConnection

from test_hyper import randomise_

LOW = [torch.float16, torch.bfloat16]


def fixed(scale: float, *shape: int, seed: int = 0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rounded_once(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # out (dtype) is ref (fp32, from the same low-precision weights and inputs) rounded once: eps/2,
    # and half the spacing of the subnormals (tiny·eps) below the smallest normal number
    assert out.dtype == dtype and out.isfinite().all()
    info = torch.finfo(dtype)
    torch.testing.assert_close(out.float(), ref, rtol=info.eps / 2, atol=info.tiny * info.eps / 2)


# ---- mHC's dynamic mixing -------------------------------------------------------------------------
def mhc(n=3, d=8) -> ManifoldHyperConnection:
    torch.manual_seed(0)  # φ away from 0 (its init), or the dynamic term, and the RMS, would be 0
    return randomise_(ManifoldHyperConnection(n, d, index=4, dynamic=True, eps=1e-5))


def mhc_weights_before(c: ManifoldHyperConnection, h: torch.Tensor):
    # ManifoldHyperConnection.weights as it was before the fp32 (commit f6afd39), op for op
    n = c.n
    phi = (c.norm.weight[:, None] * c.phi).view(n, -1, c.phi.shape[1])
    z = torch.bmm(h.flatten(1, 2), phi).sum(0).view(*h.shape[1:3], -1)
    z = z * torch.rsqrt(h.pow(2).mean(dim=(0, 3)) + c.norm.eps)[..., None]
    pre = c.b_pre[:, None, None] + c.scale[0] * z[..., :n].permute(2, 0, 1)
    post = c.b_post[:, None, None] + c.scale[1] * z[..., n:2 * n].permute(2, 0, 1)
    res = c.b_res[:, :, None, None] + c.scale[2] * z[..., 2 * n:].unflatten(-1, (n, n)).permute(2, 3, 0, 1)
    return torch.sigmoid(pre), sinkhorn_before(res).transpose(0, 1), 2 * torch.sigmoid(post)


def sinkhorn_before(logits, iters=20):
    m = torch.exp(logits - logits.amax(dim=(0, 1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(dim=1, keepdim=True)
        m = m / m.sum(dim=0, keepdim=True)
    return m


@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_mhc_dynamic_weights_in_fp32_are_the_formula(scale):
    # Since 977edb3 the weights are computed tokens-last with another summation order than the code
    # before: equal to the bit under ATen's default kernels, within 1 ulp at 1 under AVX2 (issue 34;
    # the entries are <= 2, a Sinkhorn matrix's sum to 1). 8 ulps at 1 is far below a wrong formula.
    c, h = mhc(), fixed(scale, 3, 2, 5, 8)
    eps = torch.finfo(torch.float32).eps
    for out, want in zip(c.weights(h), mhc_weights_before(c, h)):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, want, rtol=8 * eps, atol=8 * eps)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("scale", [0.0, 1.0, 1e3])  # 1e3: H² = 1e6 > fp16's 65504, the RMS was inf
def test_mhc_dynamic_weights_in_low_precision_are_their_fp32_value_rounded_once(scale, dtype):
    # The whole module in the dtype, as precision=16-true / bf16-true (under 16-mixed the streams are
    # fp32 and the mixing runs outside autocast: test_hyper.test_under_mixed_precision...). In fp16
    # at 1e3 the old code gave rsqrt(inf) = 0: the dynamic term vanished, H_post off by 25%.
    low = mhc().to(dtype)
    h = fixed(scale, 3, 2, 5, 8).to(dtype)
    ref = copy.deepcopy(low).float().weights(h.float())
    for out, want in zip(low.weights(h), ref):
        rounded_once(out, want, dtype)


# ---- FixNorm ---------------------------------------------------------------------------------------
V, D, PAD = 6, 512, 0  # d 512: ‖x‖ passes fp16's 65504 from |x| ≈ 2900 on


def fixnorm_rows(scale: float, seed: int = 1) -> torch.Tensor:
    # (V, D) rows: row 0 zero (the pad row, and a zero decoder state), the others at `scale`, row 2
    # at 1e4 (its norm 2.3e5 is inf in fp16: the row became 0)
    rows = fixed(scale, V, D, seed=seed)
    rows[0] = 0.0
    rows[2] *= 1e4 / scale
    return rows


def embedding(rows: torch.Tensor) -> TokenEmbedding:
    e = TokenEmbedding(V, D, PAD, fixnorm=True)
    with torch.no_grad():
        e.embedding.weight.copy_(rows)
    return e


def projection(rows: torch.Tensor, scaled_input: bool) -> OutputProjection:
    p = OutputProjection(V, D, tied=None, fixnorm=True, scaled_input=scaled_input)
    with torch.no_grad():
        p.untied.weight.copy_(rows)
        if p.g is not None:
            p.g.fill_(7.3)  # not √d, so its rounding counts
    return p


TOKENS = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0]])


@pytest.mark.parametrize("scale", [1e-2, 1.0])
def test_fixnorm_in_fp32_is_f_normalize_bit_for_bit(scale):
    rows, x = fixnorm_rows(scale), fixnorm_rows(scale, seed=2)[None]  # x: (1, V, D), row 0 zero
    want = torch.nn.functional.normalize(rows, dim=-1)  # the code before: F.normalize, then the scale
    assert torch.equal(embedding(rows)(TOKENS), want[TOKENS] * D ** 0.5)
    for scaled_input in (False, True):
        p = projection(rows, scaled_input)
        x_want = x if scaled_input else p.g * torch.nn.functional.normalize(x, dim=-1)
        for out, ref in zip(p.operands(x), (x_want, want)):
            assert out.dtype == torch.float32 and torch.equal(out, ref)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("scale", [1e-2, 1.0])
def test_fixnorm_in_low_precision_is_its_fp32_value_rounded_once(scale, dtype):
    # The modules in the dtype (precision=16-true / bf16-true): in fp16 the pad row gave NaN (ε = 0,
    # 0/0) and row 2 zeros (‖row‖ = inf), and the decoder state x alike.
    rows, x = fixnorm_rows(scale), fixnorm_rows(scale, seed=2)[None].to(dtype)
    low = embedding(rows).to(dtype)
    rounded_once(low(TOKENS), copy.deepcopy(low).float()(TOKENS), dtype)
    for scaled_input in (False, True):
        low = projection(rows, scaled_input).to(dtype)
        for out, ref in zip(low.operands(x), copy.deepcopy(low).float().operands(x.float())):
            rounded_once(out, ref, dtype)


@pytest.mark.parametrize("dtype", LOW)
def test_fixnorm_output_under_autocast_normalises_a_low_precision_state_in_fp32(dtype):
    # 16-mixed / bf16-mixed: the weights are fp32, the decoder state x may come in the low dtype;
    # F.normalize ran in it (autocast leaves it alone), so a zero row gave NaN in fp16.
    p, x = projection(fixnorm_rows(1.0), scaled_input=False), fixnorm_rows(1.0, seed=2)[None].to(dtype)
    ref = p.operands(x.float())
    with torch.autocast("cpu", dtype=dtype):
        out = p.operands(x)
        assert p(x).isfinite().all()
    rounded_once(out[0], ref[0], dtype)
    assert torch.equal(out[1], ref[1])  # the weights are fp32: normalised as without autocast
