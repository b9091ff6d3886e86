"""The models, batches and measures shared by the training benchmarks (train_throughput.py,
profile_step.py): normlab's Transformer and two peers at one shape and five settings (three
dropout settings, two of them also with the model alone), the analytic FLOPs of a training step, a
matmul peak and the peak memory of a step.

Shapes (`--shape`): `reference` (issue 13): 6+6 layers, d 256, 4 heads, FFN 1024, tied 8k joint
vocabulary, post-norm, label smoothing 0.1, Adam; batches of 128 sentences x 32 tokens on each side.
`tiny`: `make train`'s model (conf/model/tiny.yaml: 3+3 layers, d 128, 4 heads, FFN 512, pre-norm
as conf/config.yaml's default norm), batches of 64 x 32 (its max_tokens 2048). `small`: a toy, to
check the scripts.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    d: int = 256
    layers: int = 6
    heads: int = 4
    ffn: int = 1024
    vocab: int = 8000
    batch: int = 128  # sentences per batch (synthetic batches)
    length: int = 32  # tokens per sentence on each side (synthetic batches)
    placement: str = "post"  # post | pre: every model's norm placement


def tiny_shape() -> Shape:
    # `make train`'s model: conf/model/tiny.yaml (read, so the two cannot drift apart) with
    # conf/config.yaml's default norm (prenorm), at its max_tokens 2048 per batch side (64 x 32 tokens).
    from omegaconf import OmegaConf

    m = OmegaConf.load(ROOT / "conf/model/tiny.yaml")
    for key in ("layers", "heads", "ffn"):
        assert m[f"encoder_{key}"] == m[f"decoder_{key}"], f"tiny.yaml: encoder_{key} != decoder_{key}"
    return Shape(d=m.d_model, layers=m.encoder_layers, heads=m.encoder_heads, ffn=m.encoder_ffn, batch=64,
                 placement="pre")


def shape(name: str) -> Shape:
    return {"reference": Shape, "tiny": tiny_shape, "small": lambda: small(Shape())}[name]()


SHAPES = ("reference", "tiny", "small")


# Dropout of each kind per setting: residual (sub-layer outputs), embedding (token + position),
# attention (attention weights), activation (FFN hidden). Peers get what they can express.
SETTINGS = {
    "papers": dict(residual=0.1, embedding=0.1, attention=0.0, activation=0.0),
    "everywhere": dict(residual=0.1, embedding=0.1, attention=0.1, activation=0.1),
    "none": dict(residual=0.0, embedding=0.0, attention=0.0, activation=0.0),
}
# The model alone: normlab on full logits and torch's F.cross_entropy(label_smoothing=0.1), the
# peers' loss path, instead of its chunked loss (losses.model_loss); the peers are as in the dropout
# setting named (train_throughput.py measures them once for both).
MODEL_ALONE = {"papers_model": "papers", "none_model": "none"}
SETTING_TEXT = {
    "papers": "the papers' regularisation: residual + embedding dropout 0.1",
    "everywhere": "dropout 0.1 everywhere: residual, embedding, attention, activation",
    "none": "no dropout",
    "papers_model": "the model alone (every model on full logits + F.cross_entropy), the papers' dropout",
    "none_model": "the model alone (every model on full logits + F.cross_entropy), no dropout",
}


def dropout(setting: str) -> dict:
    # The dropout of each kind in a setting (a model-alone setting: its dropout setting's).
    return SETTINGS[MODEL_ALONE.get(setting, setting)]


def build(cls, s: "Shape", setting: str, compile: bool = False):
    """A model of class `cls` for a setting: normlab on its training loss path, or with the model alone on
    full logits and the peers' loss."""
    if issubclass(cls, Normlab):
        return cls(s, dropout(setting), compile=compile, full_logits=setting in MODEL_ALONE)
    return cls(s, dropout(setting), compile=compile)


PEER_NOTES = {
    "x-transformers": "no residual dropout exists, so 'papers' gets FFN (activation) + embedding dropout",
    "torch.nn.Transformer": "one dropout for residual, attention and activation, so 'papers' = 'everywhere'",
}


def label_smoothed_ce(logits: torch.Tensor, tgt_out: torch.Tensor, ntokens) -> torch.Tensor:
    # The peers' loss: torch's own label-smoothed cross-entropy, summed over non-pad tokens.
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1), ignore_index=0,
                           label_smoothing=0.1, reduction="sum") / ntokens


class Normlab:
    name = "normlab"
    full_logits = False  # True: the model alone, on full logits and the peers' loss
    bias = True  # model.bias: biases in the attention projections and the norms

    def __init__(self, s: Shape, drop: dict, compile: bool = False, full_logits: bool = False):
        from normlab.config import ModelConfig, NormConfig
        from normlab.model.transformer import Seq2SeqTransformer

        cfg = ModelConfig(vocab_size=s.vocab, d_model=s.d, encoder_layers=s.layers, decoder_layers=s.layers,
                          encoder_heads=s.heads, decoder_heads=s.heads, encoder_ffn=s.ffn, decoder_ffn=s.ffn,
                          dropout=drop["residual"], attention_dropout=drop["attention"],
                          activation_dropout=drop["activation"], norm=NormConfig(placement=s.placement),
                          bias=self.bias)
        assert drop["embedding"] == drop["residual"], "normlab's `dropout` covers residuals and embeddings"
        self.model = Seq2SeqTransformer(cfg)
        self.forward = torch.compile(self.model) if compile else self.model
        self.full_logits = full_logits

    def logits(self, src, tgt_in):
        return self.forward(src, tgt_in)  # (B, T, V)

    def loss(self, b: dict) -> torch.Tensor:
        from normlab.losses import model_loss

        if self.full_logits:  # the model alone: the peers' loss path
            return label_smoothed_ce(self.logits(b["src"], b["tgt_in"]), b["tgt_out"], b["ntokens"])
        # As Seq2SeqModule trains: output projection and loss in row chunks, no (B, T, V) logits.
        return model_loss(self.forward, b["src"], b["tgt_in"], b["tgt_out"], 0.1, 0)[0] / b["ntokens"]


class XTransformers:
    name = "x-transformers"

    def __init__(self, s: Shape, drop: dict, compile: bool = False):
        from x_transformers import XTransformer

        # The shape's norm placement like the others; attn_flash = its SDPA path (faster here than its
        # einsum path).
        kw = dict(pre_norm=s.placement == "pre", heads=s.heads, attn_dim_head=s.d // s.heads, depth=s.layers,
                  ff_mult=s.ffn // s.d, attn_flash=True,
                  ff_dropout=drop["activation"] or drop["residual"], attn_dropout=drop["attention"],
                  emb_dropout=drop["embedding"])
        self.model = XTransformer(dim=s.d, tie_token_emb=True, ignore_index=0, pad_value=0,
                                  enc_num_tokens=s.vocab, enc_max_seq_len=256, dec_num_tokens=s.vocab,
                                  dec_max_seq_len=257, **{f"enc_{k}": v for k, v in kw.items()},
                                  **{f"dec_{k}": v for k, v in kw.items()})
        net = self.model.decoder.net  # tie the output projection too (XTransformer cannot pass it on)
        del net.to_logits
        net.to_logits = lambda t, **_: t @ net.token_emb.emb.weight.t()

    def logits(self, src, tgt_in):
        mask = src.ne(0)
        enc = self.model.encoder(src, mask=mask, return_embeddings=True)
        return self.model.decoder.net(tgt_in, context=enc, context_mask=mask)  # (B, T, V)

    def loss(self, b: dict) -> torch.Tensor:
        return label_smoothed_ce(self.logits(b["src"], b["tgt_in"]), b["tgt_out"], b["ntokens"])


class TorchTransformer:
    name = "torch.nn.Transformer"

    def __init__(self, s: Shape, drop: dict, compile: bool = False):
        p = max(drop.values())  # one rate for all its dropouts
        self.d = s.d
        self.emb = torch.nn.Embedding(s.vocab, s.d, padding_idx=0)
        self.pos = torch.nn.Embedding(256, s.d)
        self.drop = torch.nn.Dropout(drop["embedding"])
        self.core = torch.nn.Transformer(s.d, s.heads, s.layers, s.layers, s.ffn, dropout=p, batch_first=True,
                                         norm_first=s.placement == "pre")
        self.model = torch.nn.ModuleDict({"emb": self.emb, "pos": self.pos, "core": self.core})

    def embed(self, x):
        return self.drop(self.emb(x) * self.d ** 0.5 + self.pos.weight[: x.size(1)])

    def logits(self, src, tgt):
        T = tgt.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=src.device).triu(1)  # True = masked
        h = self.core(self.embed(src), self.embed(tgt), tgt_mask=causal, tgt_is_causal=True,
                      src_key_padding_mask=src.eq(0), memory_key_padding_mask=src.eq(0))
        return h @ self.emb.weight.t()  # (B, T, V)

    def loss(self, b: dict) -> torch.Tensor:
        return label_smoothed_ce(self.logits(b["src"], b["tgt_in"]), b["tgt_out"], b["ntokens"])


class NormlabNoBias(Normlab):
    """Not a peer: normlab's model without the biases x-transformers does not have, to measure what
    they cost (issue 21's tiny-shape gap). fairseq and torch.nn.Transformer (nn.MultiheadAttention)
    give every attention projection and every LayerNorm a bias, and so does normlab (Vaswani et al.
    2017 write the projections without one; tensor2tensor's attention has none, its LayerNorm has
    one); x-transformers has none there (its FFN keeps them). At the tiny shape: normlab 131
    parameter tensors (65 biases), this variant 78 (12, the FFN's), x-transformers 80 (12; its 2
    more are learned position embeddings, which normlab's sinusoids do not need). The model is
    otherwise normlab's: normlab's `model.bias=false`."""
    name = "normlab-nobias"
    bias = False


PEERS = (Normlab, XTransformers, TorchTransformer)
VARIANTS = (NormlabNoBias,)  # normlab's own variants: timed in turns, never a peer


def synthetic_batches(s: Shape, n: int, device, seed: int = 0) -> list[dict]:
    # Full-length sentences (no padding), as the reference measurement; ids >= 3 (0-2 special).
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        src = torch.randint(3, s.vocab, (s.batch, s.length), generator=g)
        tgt = torch.randint(3, s.vocab, (s.batch, s.length + 1), generator=g)
        tgt[:, 0] = 1  # BOS
        out.append({"src": src.to(device), "tgt_in": tgt[:, :-1].to(device), "tgt_out": tgt[:, 1:].to(device),
                    "ntokens": s.batch * s.length})
    return out


def corpus_batches(n: int, vocab: int, max_tokens: int, device) -> list[dict]:
    # The bundled de-en corpus, token-bucketed as training batches it (padding included).
    from normlab.data.datamodule import TranslationDataModule

    root = ROOT / "data" / "bible_de_en"
    files = {f"{split}_{side}": str(root / f"{split}.{lang}.gz") for split in ("train", "valid", "test")
             for side, lang in (("src", "de"), ("tgt", "en"))}
    dm = TranslationDataModule(**files, vocab_size=vocab, max_tokens=max_tokens, cache_dir=str(ROOT / ".cache/normlab"))
    dm.setup("fit")
    out = []
    for b in dm.train_dataloader():
        out.append({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()
                    if k in ("src", "tgt_in", "tgt_out", "ntokens")})
        if len(out) == n:
            break
    return out


def step_flops(s: Shape, b: dict) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3 x forward) at the padded batch
    shape, the same count for every model (so MFU ratios equal throughput ratios)."""
    B, S = b["src"].shape
    T = b["tgt_in"].size(1)
    d, f = s.d, s.ffn
    enc = B * S * s.layers * (2 * 4 * d * d + 2 * 2 * d * f + 2 * 2 * S * d)  # q,k,v,o; fc1,fc2; QK, AV
    dec = s.layers * (B * T * (2 * 6 * d * d + 2 * 2 * d * f + 2 * 2 * T * d + 2 * 2 * S * d)
                      + B * S * 2 * 2 * d * d)  # self q,k,v,o + cross q,o; FFN; two attentions; cross k,v
    out = B * T * 2 * d * s.vocab
    return 3.0 * (enc + dec + out)


def matmul_peak(device, seconds: float = 1.0) -> float:
    """Best fp32 matmul FLOP/s over a few square sizes, measured now with the current threads."""
    best = 0.0
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        a @ b
        reps, t_end = 0, time.perf_counter() + seconds / 3
        while time.perf_counter() < t_end or reps < 2:
            t0 = time.perf_counter()
            a @ b
            _sync(device)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
            reps += 1
    return best


def peak_step_memory(peer, opt, b: dict, device) -> float:
    """Peak bytes live during one full step (parameters, gradients, Adam state, activations,
    temporaries). CUDA: the allocator's peak; elsewhere: LiveBytes below (tensor storages)."""
    def step():
        opt.zero_grad(set_to_none=True)
        peer.loss(b).backward()
        opt.step()

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated())
    tracker = LiveBytes()
    for t in [*peer.model.parameters(), *(p.grad for p in peer.model.parameters()),
              *(v for st in opt.state.values() for v in st.values())]:
        tracker.add(t)
    with tracker:
        step()
    return float(tracker.peak)


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages alive, and their peak, over the ops run inside the mode (plus any
    tensor `add`ed before): each new storage counts until its Python object is collected, which
    with torch's storage object preservation is when the storage itself is freed."""

    def __init__(self):
        super().__init__()
        self.seen: set[int] = set()
        self.now = self.peak = 0

    def add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self.seen or st.nbytes() == 0:
            return
        self.seen.add(key)
        self.now += st.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(st, self._free, key, st.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.add(t)
        return out


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_step(peer, opt, b: dict, device) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    peer.loss(b).backward()
    opt.step()
    _sync(device)
    return time.perf_counter() - t0


def adam(params, device) -> torch.optim.Optimizer:
    # The same optimizer for every model, as normlab's trainer runs it (lit_module._adam_impl): fused
    # on GPU, foreach on CPU.
    cuda = torch.device(device).type == "cuda"
    return torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=cuda or None,
                            foreach=None if cuda else True)


def small(s: Shape) -> Shape:
    # For checking the scripts quickly, not for the record.
    return replace(s, d=64, layers=2, ffn=256, vocab=1000, batch=16, length=16)


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    ys = sorted(xs)
    mid = len(ys) // 2
    med = ys[mid] if len(ys) % 2 else 0.5 * (ys[mid - 1] + ys[mid])
    return ys[0], med, ys[-1]


def fmt_int(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else "-"
