"""One code path from a model and a data loader to sacreBLEU / chrF with signatures.

Training (validation, and the final valid / test passes of final_test.py), the `evaluate` command and
the prune command all call `translate_batches` + `score`, so a number printed anywhere is computed
the same way.
BLEU is sacreBLEU's default: detokenised output against raw references, 13a tokenisation,
exp smoothing; its signature is reported beside every score.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from sacrebleu.metrics import BLEU, CHRF

Decoder = Callable[[torch.nn.Module, torch.Tensor], list[list[int]]]


def make_decoder(beam: int = 1, lenpen: float = 0.6, max_len_a: float = 1.0, max_len_b: int = 50,
                 min_len: int = 0) -> Decoder:
    """Greedy for beam == 1, else beam search (defaults: Vaswani et al. 2017, beam 4, alpha 0.6)."""
    if beam < 1:
        raise ValueError(f"eval.decoder.beam={beam} must be >= 1")
    if beam == 1:
        from normlab.decoding.greedy import greedy_decode

        return lambda model, src: greedy_decode(model, src, max_len_a=max_len_a, max_len_b=max_len_b,
                                                min_len=min_len)
    from normlab.decoding.beam import beam_search

    return lambda model, src: [nbest[0]["tokens"] for nbest in beam_search(
        model, src, beam=beam, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len)]


def score(hypotheses: list[str], references: list[str]) -> dict:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2),
            "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature())}


@torch.no_grad()
def translate_batches(model: torch.nn.Module, batches: Iterable[dict], decode: Decoder,
                      detok: Callable[[list[list[int]]], list[str]]) -> dict[int, str]:
    """Hypotheses keyed by sentence index (batches carry `idx`), so order is restored later."""
    was_training = model.training
    model.eval()
    out: dict[int, str] = {}
    device = next(model.parameters()).device
    for batch in batches:
        ids = decode(model, batch["src"].to(device))
        for i, hyp in zip(batch["idx"].tolist(), detok(ids)):
            out[i] = hyp
    model.train(was_training)
    return out


def subset_rows(n: int, size: int | None) -> tuple[int, ...] | None:
    """`size` of a split's n sentences for validation BLEU during training (eval.valid_subset): every
    (n / size)-th in the file's order (row i * n // size), spread over the whole file and the same at
    every validation and for every run seed, so the best checkpoint compares one set of sentences.
    None (all, the pass as before) when size is None or not below n."""
    if size is None or size >= n:
        return None
    return tuple(i * n // size for i in range(size))


def ordered(hyps: dict[int, str], n: int) -> list[str]:
    missing = [i for i in range(n) if i not in hyps]
    if missing:
        raise ValueError(f"{len(missing)} of {n} sentences were not translated (first: {missing[:5]})")
    return [hyps[i] for i in range(n)]


def lines_loader(tokenizer, lines: list[str], max_positions: int, max_tokens: int):
    """Batches of raw source lines built as the data module builds valid/test batches (source +
    EOS, cut to max_positions, sorted by length, token budget); batch["idx"] addresses `lines`.
    Returns (loader, number of lines cut)."""
    from normlab.data.arrays import TokenArray
    from normlab.data.batching import PairDataset, batch_loader

    src = TokenArray.from_sequences(tokenizer.encode(lines))
    n_cut = int((src.lengths > max_positions - 1).sum())
    return batch_loader(PairDataset(src, None, limit=max_positions - 1), max_tokens), n_cut
