"""Training throughput of normlab's Transformer against peers, as a ratio measured in one run.

Peers: x-transformers' XTransformer (`pip install x-transformers`; skipped if absent) and
torch.nn.Transformer, at the reference config (6+6 layers, d 256, 4 heads, FFN 1024, tied
8k joint vocabulary), post-norm, no dropout. All models see the same batches of the bundled
de-en corpus (max_tokens 2048), a full step each (forward, loss, backward, Adam step), and the
models take turns in rounds so that machine load hits them alike. Numbers are target
(non-pad) tokens per second.

    python benchmarks/train_throughput.py [--steps 30] [--rounds 3] [--threads N]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import normlab  # noqa: F401,E402  (sets OMP_WAIT_POLICY before torch loads)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from normlab.config import ModelConfig, NormConfig  # noqa: E402
from normlab.data.datamodule import TranslationDataModule  # noqa: E402
from normlab.losses import label_smoothed_nll  # noqa: E402
from normlab.model.transformer import Seq2SeqTransformer  # noqa: E402

D, LAYERS, HEADS, FFN = 256, 6, 4, 1024


def batches(n: int) -> list[dict]:
    root = Path(__file__).resolve().parents[1] / "data" / "bible_de_en"
    dm = TranslationDataModule(**{f"{s}_{side}": str(root / f"{s}.{lang}.gz") for s in ("train", "valid", "test")
                                  for side, lang in (("src", "de"), ("tgt", "en"))}, vocab_size=8000, max_tokens=2048)
    dm.setup("fit")
    out = []
    for b in dm.train_dataloader():
        out.append(b)
        if len(out) == n:
            return out, dm.tokenizer.vocab_size
    return out, dm.tokenizer.vocab_size


class Ours:
    name = "normlab"

    def __init__(self, V):
        self.model = Seq2SeqTransformer(ModelConfig(
            vocab_size=V, d_model=D, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_heads=HEADS,
            decoder_heads=HEADS, encoder_ffn=FFN, decoder_ffn=FFN, norm=NormConfig(placement="post")))

    def loss(self, b):
        logits = self.model(b["src"], b["tgt_in"])
        loss, _ = label_smoothed_nll(logits, b["tgt_out"], 0.1, 0)
        return loss / b["ntokens"]


class XTransformers:
    name = "x-transformers"

    def __init__(self, V):
        from x_transformers import XTransformer

        self.model = XTransformer(dim=D, tie_token_emb=True, ignore_index=0, pad_value=0,
                                  enc_num_tokens=V, enc_depth=LAYERS, enc_heads=HEADS, enc_max_seq_len=256,
                                  enc_ff_mult=FFN // D, dec_num_tokens=V, dec_depth=LAYERS, dec_heads=HEADS,
                                  dec_max_seq_len=257, dec_ff_mult=FFN // D)

    def loss(self, b):
        tgt = torch.cat([b["tgt_in"][:, :1], b["tgt_out"]], dim=1)  # BOS y EOS; the wrapper shifts it
        return self.model(b["src"], tgt, mask=b["src"].ne(0))


class TorchTransformer:
    name = "torch.nn.Transformer"

    def __init__(self, V):
        self.emb = torch.nn.Embedding(V, D, padding_idx=0)
        self.core = torch.nn.Transformer(D, HEADS, LAYERS, LAYERS, FFN, dropout=0.0, batch_first=True)
        self.model = torch.nn.ModuleDict({"emb": self.emb, "core": self.core})

    def loss(self, b):
        src, tgt = b["src"], b["tgt_in"]
        T = tgt.size(1)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = masked, like the pad masks
        h = self.core(self.emb(src) * D ** 0.5, self.emb(tgt) * D ** 0.5, tgt_mask=causal, tgt_is_causal=True,
                      src_key_padding_mask=src.eq(0), tgt_key_padding_mask=tgt.eq(0),
                      memory_key_padding_mask=src.eq(0))
        logits = h @ self.emb.weight.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), b["tgt_out"].view(-1), ignore_index=0,
                               label_smoothing=0.1)


def run_steps(peer, opt, bs) -> tuple[int, float]:
    t0, tok = time.perf_counter(), 0
    for b in bs:
        opt.zero_grad(set_to_none=True)
        peer.loss(b).backward()
        opt.step()
        tok += int(b["ntokens"])
    return tok, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30, help="steps per model per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bs, V = batches(args.steps)
    peers = [Ours(V), TorchTransformer(V)]
    try:
        peers.insert(1, XTransformers(V))
    except ImportError:
        print("x-transformers not installed: skipped (pip install x-transformers)")
    opts = [torch.optim.Adam(p.model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9) for p in peers]
    for p, o in zip(peers, opts):  # warm-up step, not timed
        run_steps(p, o, bs[:2])
    totals = {p.name: [0, 0.0] for p in peers}
    for _ in range(args.rounds):
        for p, o in zip(peers, opts):
            tok, sec = run_steps(p, o, bs)
            totals[p.name][0] += tok
            totals[p.name][1] += sec
    rate = {k: tok / sec for k, (tok, sec) in totals.items()}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.rounds} rounds x {args.steps} steps, "
          f"6+6 layers d{D} h{HEADS} ffn{FFN}")
    print(f"{'model':<22} {'params':>10} {'tgt tok/s':>10} {'normlab / model':>16}")
    for p in peers:
        n = sum(x.numel() for x in p.model.parameters())
        print(f"{p.name:<22} {n:>10,} {rate[p.name]:>10.0f} {rate['normlab'] / rate[p.name]:>16.2f}")


if __name__ == "__main__":
    main()
