"""A study file's claims (study/spec.py reads the rest): the Claim, and the checks each entry of
`claims:` passes when the file is read, so that a bad claim is one line naming its key before any run:
its keys and kind, its metric (an observatory name must be one: study/records.py), its arms, and
an lr_sensitivity claim's screen; a fewer_steps claim's own checks are study/fewer_steps_check.py's."""
from __future__ import annotations

from dataclasses import dataclass, replace

from normlab.errors import UserError
from normlab.study.fewer_steps_check import check_claim as check_fewer_steps
from normlab.study.records import observatory_name_problem
from normlab.study.screen import Screen

INTERVALS = ("bootstrap", "t")
KINDS = ("compare", "similar", "no_worse", "fails", "trains", "lr_sensitivity", "fewer_steps")


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str
    source: str             # paper, table / figure
    paper: str              # the paper's own number, as printed
    better: str             # arm (or best_of group) the paper says is better / that fails / trains
    than: str | None        # the other arm (compare claims)
    metric: str = "test_bleu"
    interval: str = "bootstrap"  # bootstrap: a test-BLEU claim's seed interval adds the test sentences'
                                 # variance, and its README shows the sentence bootstrap as a test-set
                                 # check; t: the seeds alone (claims.py)
    kind: str = "compare"   # compare: A better than B; similar: |A - B| < margin; fails: A diverges or
                            # stalls; trains: A completes; fewer_steps: A reaches B's last loss margin x sooner
    than_metric: str | None = None  # B's metric when it differs (a pruned model against one trained small)
    margin: float = 1.0     # similar, no_worse: the largest difference the paper would call "about as good"
                            # (fewer_steps: the smallest speed-up factor, > 1, required)
    direction: str | None = None  # higher | lower is better; default: lower for loss / nll / ppl
    paper_effect: str | None = None  # the paper's own effect for the comparison the arms make, e.g.
                                     # "+0.83 BLEU (avg of 5 TED pairs)", shown beside ours
    carried_from: str | None = None  # where the paper showed it when not on translation ("language models")
    changed: str | None = None  # why the definition differs from the one its first records fixed (study/fixed.py)
    where_fails: str | None = None  # trains claims: "trains where this arm fails", judged on the screens
    cap: float | None = None  # lr_sensitivity: ℓ0, the loss a setting counts at most (ln V; study/lr_sensitivity.py)


def check_claim(node: dict, at: str, arms: dict, best_of: dict) -> Claim:
    """One entry of `claims:`: its required keys set, its kind, direction, interval and margin among
    the allowed, and the arms (or best_of groups) it compares in the study."""
    c = Claim(**{k: node.get(k) for k in ("id", "claim", "source", "paper", "better", "than")},
              **{k: node[k] for k in ("metric", "interval", "kind", "than_metric", "margin", "direction",
                                      "paper_effect", "carried_from", "changed", "where_fails", "cap") if k in node})
    for key in ("id", "claim", "source", "paper", "better"):
        if not getattr(c, key):
            raise UserError(f"{at}.{key}", "missing")
    for key in ("paper_effect", "carried_from", "changed"):
        value = getattr(c, key)
        if value is not None and not (isinstance(value, str) and value.strip()):
            raise UserError(f"{at}.{key}", f"{value!r}: must be a non-empty string (or left out)")
    if c.kind not in KINDS:
        raise UserError(f"{at}.kind", f"{c.kind!r} is not a kind", KINDS)
    if c.direction not in (None, "higher", "lower"):
        raise UserError(f"{at}.direction", f"{c.direction!r} is not a direction", ["higher", "lower"])
    if c.interval not in INTERVALS:
        raise UserError(f"{at}.interval", f"{c.interval!r} is not an interval", INTERVALS)
    if c.kind in ("similar", "no_worse", "lr_sensitivity") and not (isinstance(c.margin, (int, float)) and not isinstance(c.margin, bool)
                                                 and c.margin > 0):
        raise UserError(f"{at}.margin", f"{c.margin!r}: a {c.kind} claim needs a positive number (BLEU, or the metric's unit)")
    for key in ("metric", "than_metric"):  # an observatory name is checked now, not read as "no score" at judging
        value = getattr(c, key)
        problem = observatory_name_problem(value) if isinstance(value, str) and value.startswith("obs.") else None
        if problem:
            raise UserError(f"{at}.{key}", *problem)
    c = check_fewer_steps(c, at, node) if c.kind == "fewer_steps" else c  # a speed-up margin, a curve (study/fewer_steps_check.py)
    for side in (c.better, c.than) if c.kind not in ("fails", "trains") else (c.better,):
        if side not in arms and side not in best_of:
            raise UserError(f"{at}", f"{side!r} is not an arm or best_of group", [*arms, *best_of])
    if c.where_fails is not None and (c.kind != "trains" or c.where_fails not in arms):
        raise UserError(f"{at}.where_fails", f"{c.where_fails!r}: an arm, on a trains claim", list(arms))
    if c.kind == "lr_sensitivity" or c.cap is not None:
        sensitivity_claim(c, at, arms, "margin" in node)
    if c.kind == "lr_sensitivity" and "metric" not in node:
        c = replace(c, metric=None)  # not test_bleu: it reads the screens' metric (set with the screen)
    return c


def sensitivity_claim(c: Claim, at: str, arms: dict, margin_set: bool) -> None:
    """An lr_sensitivity claim compares two arms' screens (no best_of group: it has no one screen), with
    its own margin (no default: it is the verdict's rule) and a positive `cap` (ln V); `cap` is for
    that kind only."""
    if c.kind != "lr_sensitivity":
        raise UserError(f"{at}.cap", "only an lr_sensitivity claim has a cap", ["lr_sensitivity"])
    if not margin_set:
        raise UserError(f"{at}.margin", "missing: an lr_sensitivity claim states its margin (nats) before the data")
    if isinstance(c.cap, bool) or not isinstance(c.cap, (int, float)) or not c.cap > 0:
        raise UserError(f"{at}.cap", f"{c.cap!r}: an lr_sensitivity claim needs a positive number (ℓ0: ln V, the "
                        "loss of a uniform prediction)")
    for side in (c.better, c.than):
        if side not in arms:
            raise UserError(f"{at}", f"{side!r}: an lr_sensitivity claim compares two arms' screens", list(arms))


def sensitivity_screen(screen: Screen | None, claims: list[Claim], arms: dict, where: str):
    """The screen, checked for the lr_sensitivity claims: it varies optim.lr and screens both arms.
    Each such claim's metric becomes the one it reads, the screen's `by` (claims.json, the fixed
    definition and the README name it); a `metric:` it was given must be that one."""
    for i, c in enumerate(claims):
        if c.kind != "lr_sensitivity":
            continue
        if screen is None or "optim.lr" not in dict(screen.grid):
            raise UserError(f"{where}: claims[{i}]", "an lr_sensitivity claim reads the screens: the study needs a "
                            "screen whose grid has optim.lr")
        if screen.by not in ("valid_loss", "valid_nll"):  # a loss in nats, capped at ln V: not BLEU, not ppl
            raise UserError(f"{where}: screen.by", f"{screen.by}: claim {c.id!r} (lr_sensitivity) reads losses in "
                            "nats", ["valid_loss", "valid_nll"])
        for side in (c.better, c.than):
            if not arms[side].screen:
                raise UserError(f"{where}: arms.{side}.screen", f"false, but claim {c.id!r} reads its screen")
        if c.metric not in (None, screen.by):
            raise UserError(f"{where}: claims[{i}].metric", f"{c.metric}: an lr_sensitivity claim reads its arms' "
                            f"screens, ranked by screen.by", [screen.by])
        claims[i] = replace(c, metric=screen.by)
    return screen
