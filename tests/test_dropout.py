"""normlab's Dropout: the CPU mask keeps each element with probability 1 - p (to 2^-17), kept
elements scaled by 1 / P(keep) so the expectation is exact, limits p = 0 / 1 / eval, the fused
residual add, and gradients."""
import math

import pytest
import torch
import torch.nn.functional as F

from normlab.model.dropout import Dropout, _keep_mask

N = 200_000


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_keep_rate_and_exact_expectation(p):
    torch.manual_seed(0)
    d = Dropout(p).train()
    x = torch.ones(N)
    y = d(x)
    kept = y.ne(0)
    drop = round(p * 2 ** 16)
    keep_p = 1 - drop / 2 ** 16
    assert abs(keep_p - (1 - p)) <= 2 ** -17
    sd = math.sqrt(keep_p * (1 - keep_p) / N)
    assert abs(kept.float().mean().item() - keep_p) < 5 * sd  # a 5-sigma band: fails only if biased
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / keep_p))  # E[y] = x exactly
    # Neighbours share one 64-bit draw: their masks must still be independent.
    pairs = (kept[0::2] & kept[1::2]).float().mean().item()
    assert abs(pairs - keep_p ** 2) < 5 * math.sqrt(keep_p ** 2 * (1 - keep_p ** 2) / (N // 2))


def test_limits_and_eval_are_exact():
    x = torch.randn(3, 5, 7)
    assert torch.equal(Dropout(0.0).train()(x), x)
    assert torch.equal(Dropout(0.5).eval()(x), x)
    assert torch.equal(Dropout(1.0).train()(x), torch.zeros_like(x))
    r = torch.randn_like(x)
    assert torch.equal(Dropout(0.5).eval().add(r, x), r + x)
    assert torch.equal(Dropout(1.0).train().add(r, x), r)


def test_same_seed_same_mask_and_add_equals_plus():
    d = Dropout(0.2).train()
    x, r = torch.randn(4, 9, 16), torch.randn(4, 9, 16)
    torch.manual_seed(5)
    a = d(x)
    torch.manual_seed(5)
    torch.testing.assert_close(d.add(r, x), r + a)
    torch.manual_seed(5)
    torch.testing.assert_close(d(x), a)


def test_gradients_follow_the_mask():
    d = Dropout(0.25).train()
    x = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    r = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 11, dtype=torch.float64)
    torch.manual_seed(1)
    y = d.add(r, x)
    gx, gr = torch.autograd.grad(y, (x, r), g)
    scale = (y - r).detach() / x.detach()  # 0 where dropped, 1 / P(keep) where kept
    torch.testing.assert_close(gx, g * scale)
    torch.testing.assert_close(gr, g)


def test_mask_of_odd_sizes_and_other_devices_fall_back():
    for n in (1, 3, 5, 4099):  # not a multiple of the four uniforms per draw
        assert _keep_mask(torch.empty(n), 6554).shape == (n,)
    assert Dropout(0.5).train()(torch.randn(8, dtype=torch.float64)).dtype == torch.float64
    # Off the CPU (GPU; here the meta device) it is torch's own dropout.
    assert Dropout(0.5).train()(torch.ones(100, device="meta")).device.type == "meta"


def test_mask_is_the_first_n_uniforms_of_the_draw_at_every_size():
    # Four int16 uniforms per int64 draw, element i keeps iff uniform i >= threshold: whether or not
    # n is a multiple of four (no slice then), the same draw gives the same mask.
    for shape in ((64, 32, 128), (3, 5, 7), (2, 6), (1,)):
        n = math.prod(shape)
        torch.manual_seed(3)
        bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(1 << 63), None)
        expected = (bits.view(torch.int16)[:n] >= 6554 - (1 << 15)).view(shape)
        torch.manual_seed(3)
        assert torch.equal(_keep_mask(torch.empty(shape), 6554), expected)


def test_under_torch_compile_it_is_torchs_dropout():
    d = torch.compile(Dropout(0.5).train(), backend="aot_eager")
    y = d(torch.ones(4000))
    assert set(y.unique().tolist()) <= {0.0, 2.0} and 0.4 < y.ne(0).float().mean().item() < 0.6


def test_fused_add_still_runs_forward_hooks_on_the_dropout():
    d = Dropout(0.3).train()
    seen = []
    d.register_forward_hook(lambda m, args, out: seen.append(out))
    x, r = torch.randn(5, 8), torch.randn(5, 8)
    y = d.add(r, x)
    assert len(seen) == 1
    torch.testing.assert_close(y, r + seen[0])


def test_nan_stays_nan_where_dropped_as_in_torch():
    """Divergence must show: a NaN activation is NaN after dropout at dropped positions too
    (torch's dropout multiplies by the mask; a where() would turn it into 0)."""
    x = torch.full((64, 64), float("nan"), requires_grad=True)
    drop = Dropout(0.5).train()
    torch.manual_seed(0)
    assert torch.isnan(drop(x)).all() and torch.isnan(drop.add(torch.zeros(64, 64), x)).all()
    assert torch.isnan(F.dropout(x, 0.5, True)).all()  # the reference behaviour
    ones = torch.ones(64, 64, requires_grad=True)
    drop(ones).backward(torch.full((64, 64), float("nan")))
    assert torch.isnan(ones.grad).all()  # gradients likewise


def test_fused_add_keeps_a_wider_residual_stream():
    """Under CPU autocast the branch is bf16 and the residual fp32: residual + dropout(x) is fp32,
    equal to the unfused sum (it was rounded to bf16 by an in-place add)."""
    residual = torch.randn(32, 48) * 3
    x = torch.randn(32, 48).to(torch.bfloat16)
    drop = Dropout(0.3).train()
    torch.manual_seed(1)
    fused = drop.add(residual, x)
    torch.manual_seed(1)
    plain = residual + drop(x)
    assert fused.dtype == plain.dtype == torch.float32
    assert torch.equal(fused, plain)
