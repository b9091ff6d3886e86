"""QK-norm and HybridNorm's QKV-norm in fp16 and bf16 (issue 20): the normalisations and the attention
output against fp32 with copied weights. fp16's largest value is 65504, so a square overflows from
|x| = 256 on, and F.normalize's ε = 1e-12 is 0 in fp16 (a zero vector gives 0/0); the norms compute
their statistics in fp32 and round once at the end (norms.widened; OLMo's and HF Llama's RMSNorm
alike). The whole module in the low dtype (`.to(dtype)`, as precision=16-true) and CPU autocast
(as 16-mixed / bf16-mixed) are both checked."""
import copy

import pytest
import torch

from normlab.config import NormConfig
from normlab.model.attention import MultiheadAttention
from normlab.model.qk_norms import L2QKNorm, QKVNorm, RMSQKNorm
from normlab.model.norms import RMSNorm, ScaleNorm

G0 = 11.98  # Henry et al.'s g₀ = log₂(L² − L) at L = 64, deep_recent's QK-norm arm
DH = 16
LOW = [torch.float16, torch.bfloat16]


def fixed(scale: float, *shape: int) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(0))


NORMS = {"l2_query": (lambda: L2QKNorm(G0), "query"), "l2_key": (lambda: L2QKNorm(G0), "key"),
         "rms": (lambda: _gain(RMSNorm(DH, 1e-5)), "forward"), "scalenorm": (lambda: ScaleNorm(512), "forward")}


def _gain(norm):  # a gain that is not all ones, so its rounding counts too
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()))
    return norm


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("scale", [0.0, 1e-2, 1.0, 1e3])  # 0: ε; 1e3: x² = 1e6 > fp16's 65504
@pytest.mark.parametrize("norm", list(NORMS))
def test_a_norm_in_low_precision_is_its_fp32_value_rounded_once(norm, scale, dtype):
    # The same low-precision input and weights (g rounded to the dtype) for both, so neither's own
    # rounding counts: the fp32 computation, rounded to the dtype at the end, is within eps/2.
    factory, method = NORMS[norm]
    low = factory().to(dtype)
    x = fixed(scale, 3, 5, DH).to(dtype)
    ref = getattr(copy.deepcopy(low).float(), method)(x.float())
    out = getattr(low, method)(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=torch.finfo(dtype).eps / 2, atol=0.0)


def attention(kind: str) -> MultiheadAttention:
    d, heads = 64, 4
    if kind == "qkv_rms":  # HybridNorm's QKV-norm with RMSNorm: it reads the un-normalised stream
        return MultiheadAttention(d, heads, inner_norm=QKVNorm(NormConfig(type="rmsnorm"), d))
    return MultiheadAttention(d, heads, qk_norm=L2QKNorm(G0) if kind == "l2" else RMSQKNorm(d // heads, 1e-5))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("scale", [1.0, 1e3])  # 1e3: q and k of ~1e3, their squares overflow fp16
@pytest.mark.parametrize("kind", ["l2", "rms", "qkv_rms"])
def test_attention_output_in_low_precision_matches_fp32(kind, scale, dtype):
    torch.manual_seed(0)
    m = attention(kind).eval()
    x, memory = fixed(scale, 2, 7, 64), fixed(scale, 2, 5, 64) + 1
    ref = m(x)
    ref_cross = m(x, memory)
    # Tolerance: the logits are bounded by L = g (ℓ2: g·q̂·k̂, |q̂·k̂| ≤ 1) or √Dh (RMS: q̂·k̂/√Dh with
    # |q̂| = |k̂| = √Dh). Rounding q̂ and k̂ (eps/2 each) moves a logit by at most L·eps, which the
    # softmax passes on as a relative change of the weights of up to 2·L·eps; the values, the weighted
    # sum and the output projection round a few more times: (2L + 4)·eps of the output's scale. fp16:
    # 0.027 (l2), 0.012 (rms); bf16 0.22 and 0.094. Computed in fp16 the RMS statistics overflow at
    # this scale and the error is ~0.8 of the output.
    # That worst case is loose: measured ≤ 1.0·eps on these fixed inputs (review), so the test holds
    # them to 4·eps, well under the worst case, which the old in-dtype computation exceeds at 1e3.
    eps = torch.finfo(dtype).eps
    low = copy.deepcopy(m).to(dtype)
    for out, want in ((low(x.to(dtype)), ref), (low(x.to(dtype), memory.to(dtype)), ref_cross)):
        assert out.dtype == dtype
        err = (out.float() - want).abs().max() / want.abs().max()
        assert err < 4 * eps, err
    with torch.autocast("cpu", dtype=dtype):
        out = m(x)
    assert ((out.float() - ref).abs().max() / ref.abs().max()) < 4 * eps
