"""The last two normalisations in fp16 and bf16 (issue 20; tests/test_qk_norm_precision.py has the
others): mHC's dynamic RMS over the flattened streams (Xie et al. 2025, model.residual=mhc with
residual_mixing=dynamic) and FixNorm's ℓ2 normalisations (Nguyen & Salazar 2019, norm.fixnorm). Each
computes in fp32 and rounds once to its input's dtype (norms.widened): in fp32 bit for bit the formula
it had, in fp16 / bf16 within eps/2 of that fp32 value, where in fp16 a square past 65504 (|x| ≥ 256)
overflowed and F.normalize's ε = 1e-12 is 0 (a zero row gave 0/0)."""
import copy

import pytest
import torch

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
def test_mhc_dynamic_weights_in_fp32_are_the_formula_bit_for_bit(scale):
    c, h = mhc(), fixed(scale, 3, 2, 5, 8)
    for out, want in zip(c.weights(h), mhc_weights_before(c, h)):
        assert out.dtype == torch.float32 and torch.equal(out, want)


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
