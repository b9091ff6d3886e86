"""Learning-rate sensitivity from an arm's screen, and the `lr_sensitivity` claim judged on it.

Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities"
(arXiv 2309.14322), introduction: "LR sensitivity measures the deviation from optimal performance
when varying LR across orders of magnitude"; their definition (§2.2; the formula as recalled, its
text not read here) for an algorithm A over a learning-rate range:

    S = E_η [ min(ℓ(A(η)), ℓ0) − ℓ* ],   ℓ* = min_η ℓ(A(η)),   ℓ0 = the loss at initialization

the expectation over a log-spaced grid of learning rates. Here, per arm, from its screen
(<out>/screen/<arm>.json, study/screen_run.py: seed `screen.seed`, validation loss at each rung):
- ℓ(η): the validation metric the screen ranks by (`screen.by`) at the last rung the setting reached.
  Every setting of a screen trains to its first rung; with `keep` < 1 those dropped there never reach
  the later ones, and their value at the rung they left is taken: an upper bound on their loss at
  the last rung when the validation loss does not rise with steps (the dropped were worse than the
  kept ones there). The result lists them (`dropped`) and the README says so. A study that reads the
  sensitivity should train every setting to one rung (one rung, or keep: 1.0): then every ℓ(η) is at
  the same step and nothing is bounded (conf/study/stability.yaml does).
- A setting that diverged has no loss: it counts as ℓ0 (the min's cap: a divergent run is no better
  than an untrained one). One the stall guard stopped counts at the input-independent floor L* its
  row records (callbacks/stall.py: the loss it sat at), capped at ℓ0.
- ℓ0: the claim's `cap`, ln V for a V-piece vocabulary: the loss of a uniform prediction, which a model
  at initialization scores up to its small initial logits (smoothed or not: a uniform prediction's
  label-smoothed loss is ln V too). A number in the claim, not measured: the screens do not log a
  validation before the first step.
- A grid with keys beside optim.lr (warmup): at each learning rate the best of its settings.
- No setting below ℓ0 (every one diverged or sat at the cap): ℓ* is not defined, no sensitivity.

The claim (`kind: lr_sensitivity`, `better` less sensitive than `than`, `margin` in nats, `cap`): one
screen per arm on one seed has no seed variance, so no interval; the rule, fixed before any screen ran:
`held` when S(better) ≤ S(than) − margin, `contradicted` when S(better) ≥ S(than) + margin, else
`inconclusive`; `not run` until both arms' screens are complete on today's grid; `no score` when an
arm has no sensitivity (above). The margin is the study's statement of how large a difference one
screen per arm can show beyond seed noise (its comment says how it was set).
"""
from __future__ import annotations

import math

from normlab.study.screen_outcome import complete, last_value

LR = "optim.lr"


def row_lr(row: dict) -> float | None:
    """The learning rate of a screen row, from its overrides (`optim.lr=0.003`)."""
    for o in row.get("overrides") or []:
        key, _, value = str(o).partition("=")
        if key.lstrip("+") == LR:
            return float(value)
    return None


def row_loss(row: dict, cap: float) -> float:
    """min(ℓ, ℓ0) of a row: its last value; a stalled run's floor; a diverged run's (or one without a
    value) the cap."""
    value = last_value(row)
    if row.get("status") == "diverged" or (value is not None and not math.isfinite(value)):
        value = None
    if value is None and row.get("status") == "stalled":
        value = row.get("floor")
    return cap if value is None else min(float(value), cap)


def sensitivity(screen: dict, cap: float) -> dict | None:
    """{"value": S, "best": ℓ*, "losses": {lr: min(ℓ, ℓ0)}, "dropped": [lrs read before the last
    rung], "cap": ℓ0, "seed": the screen's}; None for a screen that is missing, not complete, or has no
    learning rate in its settings; value and best None when no setting ended below the cap."""
    if not screen or not complete(screen):
        return None
    last = max(screen["rungs"])
    per_lr: dict[float, float] = {}
    dropped = set()
    for row in screen["settings"]:
        lr = row_lr(row)
        if lr is None:
            return None
        loss = row_loss(row, cap)
        reached = [int(k) for k, v in (row.get("values") or {}).items() if v is not None]
        if reached and max(reached) < last and row.get("status") not in ("diverged", "stalled"):
            dropped.add(lr)
        if lr not in per_lr or loss < per_lr[lr]:
            per_lr[lr] = loss
    losses = dict(sorted(per_lr.items()))
    best = min(losses.values())
    out = {"value": None, "best": None, "losses": losses, "dropped": sorted(dropped), "cap": cap,
           "seed": screen.get("seed")}
    if best < cap:
        out.update(value=sum(v - best for v in losses.values()) / len(losses), best=best)
    return out


def judge(claim, a: str, b: str, screens: dict[str, dict]) -> tuple[str, dict, str]:
    """(verdict, {arm: its sensitivity}, note) of `a` less sensitive than `b` by claim.margin."""
    sens = {arm: sensitivity(screens.get(arm), claim.cap) for arm in (a, b)}
    missing = [arm for arm, s in sens.items() if s is None]
    if missing:
        return "not run", sens, f"no complete screen of {', '.join(missing)} on today's grid"
    empty = [arm for arm, s in sens.items() if s["value"] is None]
    if empty:
        return "no score", sens, f"{', '.join(empty)}: no setting of its screen ended below the cap {claim.cap:g}"
    diff, m = sens[a]["value"] - sens[b]["value"], claim.margin
    verdict = "held" if diff <= -m else "contradicted" if diff >= m else "inconclusive"
    note = (f"LR sensitivity {a} {sens[a]['value']:.3f} − {b} {sens[b]['value']:.3f} = {diff:+.3f} nats "
            f"(margin {m:g}; one screen each, no seed variance)")
    bounded = {arm: s["dropped"] for arm, s in sens.items() if s["dropped"]}
    if bounded:
        note += "; read before the last rung (an upper bound): " + "; ".join(
            f"{arm} lr {', '.join(f'{x:g}' for x in lrs)}" for arm, lrs in bounded.items())
    return verdict, sens, note
