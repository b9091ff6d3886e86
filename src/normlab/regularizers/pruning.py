"""Pruning a LayerDrop-trained model to r of its N layers per stack (Fan, Grave & Joulin 2019, §4).

Three ways to choose the kept layers, each returning a sorted list of 0-based layer indices:

every_other(N, r): the paper's rule. With p = 1 − r/N, drop the layers at depth d (counted from 1,
    as in the paper and fairseq, whose README prunes a 16-layer model to "0,2,4,...,14", i.e. drops
    depths 2, 4, ..., 16) with d ≡ 0 (mod ⌊1/p⌋). Worked example, N = 6, r = 3: p = 1/2,
    ⌊1/p⌋ = 2, drop depths 2, 4, 6, keep depths 1, 3, 5 = indices [0, 2, 4]. N = 6, r = 4: p = 1/3,
    ⌊1/p⌋ = 3, drop depths 3, 6, keep [0, 1, 3, 4]. The rule drops ⌊N/⌊1/p⌋⌋ layers, which is N − r
    only for some (N, r) (N = 6, r = 2 would drop all six): then we drop the evenly spaced depths
    ⌈j·N/(N − r)⌉, j = 1..N−r, instead (which is the paper's set whenever (N − r) divides N).
    Arithmetic is in fractions: 1/p = N/(N − r) exactly, no float floor errors.
search_on_valid: the subset that scores best on the validation set, one stack at a time (encoder
    with the full decoder, then decoder with the chosen encoder), 2·C(N, r) evaluations instead of
    C(N, r)². Exhaustive over all C(N, r) subsets when that is ≤ `max_exhaustive` (64: C(6,3) = 20,
    C(8,4) = 70 is greedy), else greedy backward elimination: repeatedly remove the layer whose
    removal scores best (N + (N−1) + ... + (r+1) evaluations).
data_driven: the layers with the smallest learned drop rates p_d (LayerDrop with
    `layerdrop_rates: learned`, see layerdrop.py), i.e. the largest learned rates are pruned.

prune(model, keep_encoder, keep_decoder) is module surgery: a deep copy whose stacks hold only the
kept layers (any subset, in their original order) and whose ModelConfig has the new depths, so it
saves and loads like any checkpoint; its forward equals the original's with the other layers
skipped, exactly (same modules, same order; the skipped ones are identities). A DLCL or DWA
stack (model/aggregation.py) keeps the weights of the kept layers' outputs: the pruned layers leave
its weighted history.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from fractions import Fraction
from typing import Callable, Sequence

from torch import nn

from normlab.regularizers.layerdrop import LayerDropModuleList

STRATEGIES = ("every_other", "search_on_valid", "data_driven")


def _check_depth(n: int, r: int) -> None:
    if not 1 <= r <= n:
        raise ValueError(f"cannot keep {r} of {n} layers (need 1 <= kept <= {n})")


def every_other(n: int, r: int) -> list[int]:
    _check_depth(n, r)
    if r == n:
        return list(range(n))
    k = math.floor(1 / Fraction(n - r, n))  # ⌊1/p⌋, p = 1 − r/N
    drop = [d for d in range(1, n + 1) if d % k == 0]  # depths counted from 1 (paper, fairseq)
    if len(drop) != n - r:  # the rule does not give N − r layers here: evenly spaced depths
        drop = [math.ceil(Fraction(j * n, n - r)) for j in range(1, n - r + 1)]
    return [d - 1 for d in range(1, n + 1) if d not in drop]


def _best_subset(n: int, r: int, score: Callable[[list[int]], float], max_exhaustive: int) -> list[int]:
    if math.comb(n, r) <= max_exhaustive:
        return list(max(itertools.combinations(range(n), r), key=lambda keep: score(list(keep))))
    keep = list(range(n))
    while len(keep) > r:  # greedy backward elimination
        keep = max(([i for i in keep if i != j] for j in keep), key=score)
    return keep


def search_on_valid(n_enc: int, n_dec: int, r_enc: int, r_dec: int,
                    score: Callable[[list[int], list[int]], float],
                    max_exhaustive: int = 64) -> tuple[list[int], list[int]]:
    """score(keep_encoder, keep_decoder) -> higher is better (e.g. −valid loss, valid BLEU)."""
    _check_depth(n_enc, r_enc)
    _check_depth(n_dec, r_dec)
    full_dec = list(range(n_dec))
    keep_enc = _best_subset(n_enc, r_enc, lambda k: score(k, full_dec), max_exhaustive)
    keep_dec = _best_subset(n_dec, r_dec, lambda k: score(keep_enc, k), max_exhaustive)
    return keep_enc, keep_dec


def learned_rates(model: nn.Module) -> tuple[list[float], list[float]] | None:
    """Per-layer drop rates (encoder, decoder) of a model trained with learned rates, else None."""
    enc, dec = model.encoder.layers, model.decoder.layers
    if not all(isinstance(l, LayerDropModuleList) and l.rates == "learned" for l in (enc, dec)):
        return None
    return enc.drop_rates().tolist(), dec.drop_rates().tolist()


def data_driven(model: nn.Module, r_enc: int, r_dec: int) -> tuple[list[int], list[int]]:
    rates = learned_rates(model)
    if rates is None:
        raise ValueError("data_driven pruning needs a model trained with "
                         "regularizer.layerdrop_rates=learned (and LayerDrop p > 0)")
    keeps = []
    for p_d, r in zip(rates, (r_enc, r_dec)):
        _check_depth(len(p_d), r)
        # Prune the largest rates; ties (e.g. untrained rates) go to the deeper layer.
        order = sorted(range(len(p_d)), key=lambda i: (p_d[i], i))
        keeps.append(sorted(order[:r]))
    return keeps[0], keeps[1]


def choose(strategy: str, model: nn.Module, r_enc: int, r_dec: int,
           score: Callable[[list[int], list[int]], float] | None = None,
           max_exhaustive: int = 64) -> tuple[list[int], list[int]]:
    n_enc, n_dec = len(model.encoder.layers), len(model.decoder.layers)
    if strategy == "every_other":
        return every_other(n_enc, r_enc), every_other(n_dec, r_dec)
    if strategy == "search_on_valid":
        if score is None:
            raise ValueError("search_on_valid needs a validation score function")
        return search_on_valid(n_enc, n_dec, r_enc, r_dec, score, max_exhaustive)
    if strategy == "data_driven":
        return data_driven(model, r_enc, r_dec)
    raise ValueError(f"strategy={strategy!r}; allowed values: {', '.join(STRATEGIES)}")


def _subset(layers: nn.ModuleList, keep: Sequence[int]) -> nn.ModuleList:
    if isinstance(layers, LayerDropModuleList):
        return layers.subset(list(keep))
    return nn.ModuleList(layers[i] for i in keep)


def prune(model: nn.Module, keep_encoder: Sequence[int], keep_decoder: Sequence[int]) -> nn.Module:
    """A new, smaller model with only the given encoder / decoder layers (0-based, any subset)."""
    for name, keep, n in (("encoder", keep_encoder, len(model.encoder.layers)),
                          ("decoder", keep_decoder, len(model.decoder.layers))):
        if not keep or len(set(keep)) != len(keep) or not all(0 <= i < n for i in keep):
            raise ValueError(f"keep_{name}={list(keep)} must be distinct indices in [0, {n})")
    new = copy.deepcopy(model)  # the original stays intact; tied embeddings stay tied in the copy
    keep_encoder, keep_decoder = sorted(keep_encoder), sorted(keep_decoder)
    for stack, keep in ((new.encoder, keep_encoder), (new.decoder, keep_decoder)):
        stack.layers = _subset(stack.layers, keep)
        stack.aggregation = stack.aggregation.subset(keep)  # DLCL, DWA: the kept layers' rows and columns
    new.cfg = dataclasses.replace(model.cfg, encoder_layers=len(keep_encoder), decoder_layers=len(keep_decoder))
    return new.train(model.training)  # the new lists are created in training mode
