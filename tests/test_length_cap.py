"""The final decode's length cap (issue 36): a study that sets fairseq's cap in its `common` overrides
(eval.test_decoder / eval.decoder max_len_a=1.2, max_len_b=10) gets decoders whose every hypothesis
stops at floor(1.2 * |src| + 10) tokens (|src|: source tokens and EOS), while the defaults keep
|src| + 50 and every existing run its name."""
import pytest
import torch

from normlab import identity
from normlab.config import ModelConfig
from normlab.lit_module import Seq2SeqModule
from normlab.settings import EvalSpec, OptimSpec

from conftest import compose_cfg

CAP = ["eval.decoder.max_len_a=1.2", "eval.decoder.max_len_b=10", "eval.test_decoder.max_len_a=1.2",
       "eval.test_decoder.max_len_b=10"]
TINY = dict(vocab_size=40, d_model=16, encoder_ffn=32, decoder_ffn=32, encoder_layers=1, decoder_layers=1,
            encoder_heads=2, decoder_heads=2, max_positions=128)


def _module(overrides: list[str], min_len: int) -> Seq2SeqModule:
    """A random tiny model with the decoders a run of `overrides` builds (min_len set on both: a large
    one keeps every hypothesis open to its cap)."""
    from omegaconf import OmegaConf

    ev = OmegaConf.to_container(compose_cfg(overrides).eval, resolve=True)
    for d in ("decoder", "test_decoder"):
        ev[d]["min_len"] = min_len
    torch.manual_seed(0)
    return Seq2SeqModule(ModelConfig(**TINY).to_dict(), optim=OptimSpec(), eval=EvalSpec.of(ev)).eval()


def _sources() -> tuple[torch.Tensor, list[int]]:
    """Right-padded sources of several lengths, each ending in EOS; their lengths with the EOS."""
    cfg = ModelConfig(**TINY)
    lengths = [1, 3, 7, 12, 20, 33]
    g = torch.Generator().manual_seed(1)
    src = torch.full((len(lengths), max(lengths) + 1), cfg.pad_id)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(4, cfg.vocab_size, (n,), generator=g)
        src[row, n] = cfg.eos_id
    return src, [n + 1 for n in lengths]


# debug=fdr and debug=limit decode an untrained model, which writes to the cap: |src| + 5 (conf/debug)
@pytest.mark.parametrize("overrides, cap", [(CAP, lambda s: int(1.2 * s + 10)), ([], lambda s: s + 50),
                                            (["debug=fdr"], lambda s: s + 5), (["debug=limit"], lambda s: s + 5)],
                         ids=["cap", "default", "debug=fdr", "debug=limit"])
def test_every_hypothesis_stops_at_the_cap(overrides, cap):
    src, lengths = _sources()
    forced = _module(overrides, min_len=10**6)  # EOS never allowed before the cap: each runs to it
    free = _module(overrides, min_len=0)
    for decode in ("decode", "test_decode"):  # greedy (validation, the final valid pass), beam 4 (test)
        assert [len(h) for h in getattr(forced, decode)(forced.model, src)] == [cap(s) for s in lengths]
        assert all(len(h) <= cap(s) for h, s in zip(getattr(free, decode)(free.model, src), lengths))


def test_the_cap_is_a_study_opt_in():
    """The default decoders are the papers' (|src| + 50) and name every run as before; the cap makes
    another run, as any decoder setting does (a study that sets it starts new runs)."""
    base, capped = compose_cfg([]), compose_cfg(CAP)
    assert (base.eval.test_decoder.max_len_a, base.eval.test_decoder.max_len_b) == (1.0, 50)
    assert identity.run_name(base) == "bible_de_en-pre_ln-xavier-none-e3d3-s1-a59cc368"  # the pinned name
    assert identity.identity_hash(capped) != identity.identity_hash(base)
