"""benchmarks/batched.py, the batched members that batched_members.py times: its Adam on the stacked
parameters makes torch.optim.Adam's update for every member at that member's learning rate, and member
k trained 5 steps in the batch (either forward) has the losses of a single model trained 5 steps from
the same weights at the same learning rates, to 1e-5 relative. batched_members.py rejects bad arguments
before it measures anything."""
from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from normlab.config import ModelConfig, NormConfig
from normlab.losses import model_loss
from normlab.model.transformer import Seq2SeqTransformer

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def Bm():
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("bench_batched", BENCHMARKS / "batched.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.path[:] = saved
    return mod


def config(placement: str = "pre", **kw) -> ModelConfig:
    return ModelConfig(vocab_size=120, d_model=32, encoder_layers=2, decoder_layers=2, encoder_heads=4,
                       decoder_heads=4, encoder_ffn=64, decoder_ffn=64, norm=NormConfig(placement=placement), **kw)


def models(cfg: ModelConfig, seeds: list[int]) -> list[Seq2SeqTransformer]:
    out = []
    for s in seeds:
        torch.manual_seed(s)
        out.append(Seq2SeqTransformer(cfg).train())
    return out


def batches(n: int, vocab: int = 120) -> list[dict]:
    # padded on both sides, as token-bucketed training batches are
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        src = torch.randint(3, vocab, (6, 9 + i), generator=g)
        src[:2, -3:] = 0
        tgt = torch.randint(3, vocab, (6, 8 + i), generator=g)
        tgt[:, 0] = 1
        tgt[1:3, -2:] = 0
        out.append({"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:], "ntokens": int(tgt[:, 1:].ne(0).sum())})
    return out


def test_stacked_adam_is_torch_adam_per_member(Bm):
    # Three members from different seeds, gradients of different scales, learning rates per member that
    # change every step: member k's parameters after 4 steps are torch.optim.Adam's (foreach, as CPU runs
    # train, and its for-loop).
    ms = models(config(), [1, 2, 3])
    st = Bm.Stacked(ms)
    refs = [copy.deepcopy(m) for m in ms]
    opts = [torch.optim.Adam(m.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9, foreach=fe)
            for m, fe in zip(refs, (True, False, True))]
    g = torch.Generator().manual_seed(0)
    peaks = [3e-3, 1e-3, 5e-4]
    for step in range(1, 5):
        lrs = [Bm.member_lr(peak, 2, step) for peak in peaks]
        for k, m in enumerate(refs):
            for name, p in m.named_parameters():
                p.grad = torch.randn(p.shape, generator=g) * 10.0 ** (k - 1)
                st.params[name].grad[k].copy_(p.grad)
            for group in opts[k].param_groups:
                group["lr"] = lrs[k]
            opts[k].step()
        st.adam_step(lrs)
    moved = 0
    for k, m in enumerate(refs):
        for name, p in m.named_parameters():
            torch.testing.assert_close(st.params[name][k].detach(), p.detach(), rtol=1e-6, atol=0)
            moved += int((p != ms[k].state_dict()[name]).sum())
    assert moved > 0  # the update was not empty


def single_run(model: Seq2SeqTransformer, data: list[dict], peak: float, warmup: int, Bm) -> list[float]:
    """Today's step on one model (lit_module: foreach Adam, the chunked loss / target tokens)."""
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=peak, betas=(0.9, 0.98), eps=1e-9, foreach=True)
    losses = []
    for step, b in enumerate(data, 1):
        for group in opt.param_groups:
            group["lr"] = Bm.member_lr(peak, warmup, step)
        opt.zero_grad(set_to_none=True)
        loss = model_loss(model, b["src"], b["tgt_in"], b["tgt_out"], 0.1, 0)[0] / b["ntokens"]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("forward", ["vmap", "bmm"])
@pytest.mark.parametrize("placement,seeds", [("pre", [1, 1, 1]), ("post", [1, 2, 3])])
def test_members_train_as_their_single_runs(Bm, forward, placement, seeds):
    # The screen case (one seed, learning rate and warmup per member) and members from different seeds.
    settings = [(3e-3, 2), (1e-3, 4), (2e-3, 1)]
    ms, data = models(config(placement), seeds), batches(5)
    st = Bm.Stacked(ms)
    got = [[x.item() for x in Bm.batched_step(st, Bm.FORWARDS[forward], b,
                                              [Bm.member_lr(p, w, step) for p, w in settings])]
           for step, b in enumerate(data, 1)]
    for k, (m, (peak, warmup)) in enumerate(zip(ms, settings)):
        want = single_run(m, data, peak, warmup, Bm)
        assert [row[k] for row in got] == pytest.approx(want, rel=1e-5)
        assert want[-1] != want[0]
    # the members did train apart (same seed, different learning rates: different losses by step 5)
    assert len({round(x, 6) for x in got[-1]}) == len(settings)


def test_bmm_forward_is_the_model_and_names_what_it_lacks(Bm):
    ms = models(config("post"), [1, 2])
    b = batches(1)[0]
    st = Bm.Stacked(ms)
    with torch.no_grad():
        got = Bm.bmm_states(st, b["src"], b["tgt_in"])
        for k, m in enumerate(ms):
            torch.testing.assert_close(got[k], m(b["src"], b["tgt_in"], project=False), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="norm.placement=deepnorm"):
        Bm.bmm_states(Bm.Stacked(models(config("deepnorm"), [1])), b["src"], b["tgt_in"])


@pytest.mark.parametrize("argv,message", [(["--profile", "vmap"], "expected WAY:K"),
                                          (["--methods", "seq,jit"], "--methods"),
                                          (["--shapes", "base"], "--shapes: base")])
def test_script_rejects_bad_arguments_before_running(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_batched_members", BENCHMARKS / "batched_members.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def no_benchmark(*a, **k):
        raise AssertionError("the benchmark ran: the argument was not rejected first")

    for fn in ("corpus_batches", "synthetic_batches"):
        monkeypatch.setattr(mod.P, fn, no_benchmark)
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
