"""A study is data: conf/study/<name>.yaml names its arms (train.py overrides), seeds, budget,
report layout and claims; this module reads and checks it, so a bad study file is one line naming
the key before any run starts.

    title, paper, question: what the study asks, and of which paper
    formerly: [twt_lowres]     # the names the study had before it was renamed (twt_lowres_2k): its
                               # records trained then are in W&B group study-<former name> (own_groups)
    design: why this model, corpus and budget (the README prints it)
    common: [overrides every arm gets]         seeds: [1, 2, 3]
    arms: {name: {overrides: [...], label: "...", prune: {depths: [3], strategies: [...]},
                  extra_seeds: [3],     # seeds this arm runs beyond the study's (full budget only)
                  family: post_ln_like}}  # its regime family: the arms whose seed variance is pooled
    best_of: {name: {arms: [a, b], by: valid_bleu}}   # an arm picked by a validation metric
    claims: [{id, claim, source, paper, better, than, metric, than_metric, interval, kind, margin,
              paper_effect, carried_from}]   # the last two optional strings, for the READMEs and the index
    budgets: {smoke: {seeds: [1, 2], overrides: [...]}}   # study.budget=smoke: a test in seconds
    paper_preset: {command: ..., gpu_hours: ...}           # the papers' sizes, for GPU users
    plots: {curves: valid_loss}
    reference: pre_ln          # the arm a `trains` claim is measured against (required for trains_bar)
    trains_bar: {valid_nll: 0.3, test_bleu_ratio: 0.5}  # "trains": mean valid NLL within 0.3 nats of
                               # the reference's, or mean test BLEU >= 0.5 x its (these defaults)
    plateau: {window: 500, min_delta: 0.01, cap: 2000}  # a run still improving at the end (no
                               # plateau: normlab.plateau) makes a comparison "budget-bound"
    screen: {grid: {optim.lr: [...]}, rungs: [250, 1000], keep: 0.25, seed: 1}   # study/screen.py
    arms: {name: {screen: false}}   # an arm the screen leaves at the common settings
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from normlab.errors import UserError
from normlab.identity import study_group
# the claims' definition and checks (Claim: claims.py and the tests import it from here)
from normlab.study.claim_check import Claim, check_claim, sensitivity_screen
from normlab.study.screen import Screen, load_screen

METRICS_LOWER_BETTER = ("loss", "nll", "ppl")  # a metric whose name ends with one of these
# Every study's smoke budget adds these to its own (a 2-layer, few-step run with short decodes): a
# test of the machinery in seconds, never a result.
SMOKE = ["trainer.max_steps=6", "trainer.val_check_interval=3", "model.d_model=32", "model.encoder_ffn=64",
         "model.decoder_ffn=64", "model.encoder_heads=2", "model.decoder_heads=2", "data.max_tokens=512",
         "eval.decoder.max_len_a=0", "eval.decoder.max_len_b=4", "eval.test_decoder.max_len_a=0",
         "eval.test_decoder.max_len_b=4", "eval.test_decoder.beam=2", "++trainer.limit_val_batches=2",
         "++trainer.limit_test_batches=2", "callbacks.full_checkpoint.every_n_steps=3"]


# ... and the prune command's: a few sentences, short decodes
SMOKE_PRUNE = {"max_sentences": 20, "beam": 2, "max_len_a": 0, "max_len_b": 4}


def lower_is_better(metric: str) -> bool:
    return metric.rsplit("_", 1)[-1] in METRICS_LOWER_BETTER or metric.endswith(METRICS_LOWER_BETTER)


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]
    label: str
    prune: dict | None = None  # {depths: [..], strategies: [..]}: run the prune command after training
    model: dict | None = None  # probe studies: the ModelConfig options of the arm
    # seeds beyond the study's, for the arms of a claim whose seeds left it open ("inconclusive
    # (needs N seeds)": claims.py): a third seed of two arms, not of every arm
    extra_seeds: tuple[int, ...] = ()
    screen: bool = True  # false: the arm runs at the common settings though the study screens the others
    family: str | None = None  # its regime family (claims pool the seed variance over it); None: alone


@dataclass(frozen=True)
class TrainsBar:
    """How close to the study's reference arm a `trains` claim's arm must end (issue 35, item 4)."""
    valid_nll: float = 0.3        # nats: mean valid NLL at most this much above the reference's, or
    test_bleu_ratio: float = 0.5  # mean test BLEU at least this share of the reference's


@dataclass(frozen=True)
class Plateau:
    """normlab.plateau's rule, for records whose results.json does not say where the run ended."""
    window: int
    min_delta: float
    cap: int


@dataclass(frozen=True)
class Study:
    name: str
    path: Path
    title: str
    paper: str
    question: str
    design: str
    common: tuple[str, ...]
    seeds: tuple[int, ...]
    arms: dict[str, Arm]
    best_of: dict[str, dict]
    claims: tuple[Claim, ...]
    budget: str = "full"
    budget_overrides: tuple[str, ...] = ()
    paper_preset: dict = field(default_factory=dict)
    curves: str = "valid_loss"
    table_metrics: tuple[str, ...] = ("test_bleu", "test_chrf", "valid_bleu", "valid_nll", "end.train_nll")
    prune_overrides: dict = field(default_factory=dict)  # the budget's prune settings (smoke: 20 sentences)
    kind: str = "train"     # train: arms are runs | probe: a measurement at init (normlab.study.probe)
    probe: dict = field(default_factory=dict)
    screen: Screen | None = None  # each arm's setting chosen by successive halving (study/screen.py)
    reference: str | None = None        # the arm `trains` claims are measured against (with trains_bar)
    trains_bar: TrainsBar | None = None  # set when reference is
    plateau: Plateau | None = None      # None: no comparison is judged budget-bound
    formerly: tuple[str, ...] = ()      # the names it had before a rename (its old runs' W&B groups)

    def screened(self, arm: Arm) -> bool:
        return self.screen is not None and arm.screen

    def seeds_of(self, arm: Arm) -> tuple[int, ...]:
        """The seeds an arm runs: the study's, and at the full budget its extra_seeds."""
        return tuple(sorted({*self.seeds, *arm.extra_seeds})) if self.budget == "full" else self.seeds

    @property
    def all_seeds(self) -> tuple[int, ...]:
        return tuple(sorted({s for arm in self.arms.values() for s in self.seeds_of(arm)} or self.seeds))

    @property
    def planned(self) -> int:
        return sum(len(self.seeds_of(arm)) for arm in self.arms.values())

    def arm_overrides(self, arm: Arm, seed: int) -> list[str]:
        return [*self.common, *arm.overrides, *self.budget_overrides, f"seed={seed}"]

    def members(self, name: str) -> list[str]:
        """The arms a claim's side stands for: an arm, or the candidates of a best_of group."""
        return list(self.best_of[name]["arms"]) if name in self.best_of else [name]


def study_dir() -> Path:
    from normlab.commands.train import config_dir

    return config_dir() / "study"


def available() -> list[str]:
    return sorted(p.stem for p in study_dir().glob("*.yaml"))


def _need(node: dict, key: str, where: str, kind: type | tuple = str) -> Any:
    if key not in node or node[key] is None:
        raise UserError(f"{where}.{key}", "missing")
    if not isinstance(node[key], kind):
        raise UserError(f"{where}.{key}", f"must be a {getattr(kind, '__name__', kind)}")
    return node[key]


def load_study(name: str, budget: str = "full") -> Study:
    """conf/study/<name>.yaml, or a study file given by its path (<file>.yaml). Each part is checked in
    the file's order (arms, best_of, claims, budget, kind, then title, screen, judging), so the first
    bad key is the one named."""
    path, raw = _read(name)
    name, where = path.stem, f"{path.name}"
    arms = _arms(_need(raw, "arms", where, dict), where)
    best_of = _best_of(raw, where, arms)
    claims = [check_claim(node, f"{where}: claims[{i}]", arms, best_of) for i, node in enumerate(raw.get("claims") or [])]
    budgets = raw.get("budgets") or {}
    seeds, extra = _budget(raw, name, budget, budgets)
    kind, probe = _kind(raw, where, arms, budget, budgets)
    if kind == "probe":
        extra = []  # a probe trains nothing: its smoke budget is fewer depths and a narrower model
    prune_extra = dict((budgets.get(budget) or {}).get("prune") or (SMOKE_PRUNE if budget == "smoke" else {}))
    plots = raw.get("plots") or {}
    screen = sensitivity_screen(_screen(raw, budgets.get(budget) or {}, where, seeds, kind), claims, arms, where)
    return Study(name=name, path=path, title=str(_need(raw, "title", where)), paper=str(_need(raw, "paper", where)),
                 question=str(_need(raw, "question", where)), design=str(raw.get("design") or ""),
                 common=tuple(map(str, raw.get("common") or [])), seeds=tuple(int(s) for s in seeds), arms=arms,
                 best_of=best_of, claims=tuple(claims), budget=budget, budget_overrides=tuple(extra),
                 paper_preset=raw.get("paper_preset") or {}, curves=str(plots.get("curves") or "valid_loss"),
                 table_metrics=tuple(raw.get("table_metrics") or Study.table_metrics), kind=kind, probe=probe,
                 prune_overrides=prune_extra, screen=screen, formerly=_formerly(raw, where, name),
                 **_judging(raw, where, arms))


def former_names(node) -> tuple[str, ...]:
    """`formerly:` read leniently (own_groups reads it without loading the study): a list of names, else
    none (a string is not iterated as letters)."""
    return tuple(n for n in node if isinstance(n, str) and n) if isinstance(node, list) else ()


def _formerly(raw: dict, where: str, name: str) -> tuple[str, ...]:
    """`formerly:` the study's earlier names: a list of other names than its own, each once."""
    node = raw.get("formerly")
    if node is None:
        return ()
    names = former_names(node)
    if not isinstance(node, list) or len(names) != len(node) or len(set(names)) != len(names):
        raise UserError(f"{where}: formerly", f"{node!r}: not a list of the study's earlier names, each once "
                                              "(allowed: e.g. [twt_lowres])")
    if name in names:
        raise UserError(f"{where}: formerly", f"{name} is this study's own name, not an earlier one")
    return names


def own_groups(name: str) -> set[str]:
    """The W&B groups (full budget) a study's own runs were trained in: study-<name>, and study-<former
    name> for each name in its file's `formerly:` (a run keeps the group it was trained in; a renamed
    study's runs from before the rename are in its old name's group). Read without checking the rest
    of the file; a folder with no study file (an earlier study's page): its own name's only."""
    path = study_dir() / f"{name}.yaml"
    formerly: tuple[str, ...] = ()
    if path.is_file():
        try:
            formerly = former_names(OmegaConf.to_container(OmegaConf.load(path)).get("formerly"))
        except Exception:  # unreadable: named when the study itself is loaded
            formerly = ()
    return {study_group(n) for n in [name, *formerly]}


def _read(name: str) -> tuple[Path, dict]:
    """The study file's path (a name in conf/study/, or a path ending in .yaml) and its contents,
    interpolations resolved; a missing or unreadable file is one line naming it."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else study_dir() / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"study {path.stem!r}", "no such study", available())
    try:
        return path, OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # YAML syntax: the file and its line
        raise UserError(str(path), f"not a readable study file: {str(e).splitlines()[0]}") from None


def _arms(nodes: dict, where: str) -> dict[str, Arm]:
    """`arms:` as Arm objects, each key checked for its type (overrides a list, extra_seeds integers,
    screen a boolean, family a name)."""
    arms = {}
    for arm_name, node in nodes.items():
        node = node or {}
        overrides = node.get("overrides") or []
        if not isinstance(overrides, list):
            raise UserError(f"{where}: arms.{arm_name}.overrides", "must be a list of train.py overrides")
        extra = node.get("extra_seeds") or []
        if not isinstance(extra, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in extra):
            raise UserError(f"{where}: arms.{arm_name}.extra_seeds", f"must be a list of integer seeds (got {extra!r})")
        if not isinstance(node.get("screen", True), bool):
            raise UserError(f"{where}: arms.{arm_name}.screen", f"{node['screen']!r}: true or false")
        family = node.get("family")
        if family is not None and not (isinstance(family, str) and family):
            raise UserError(f"{where}: arms.{arm_name}.family", f"must be a name (got {family!r})")
        arms[arm_name] = Arm(arm_name, tuple(map(str, overrides)), str(node.get("label") or arm_name), node.get("prune"),
                             node.get("model"), tuple(extra), bool(node.get("screen", True)), family)
    return arms


def _best_of(raw: dict, where: str, arms: dict[str, Arm]) -> dict:
    """`best_of:` groups, each of >= 2 of the study's arms with the same extra seeds; `by` defaults to
    valid_bleu (set in the file's own mapping, as the pick reads it)."""
    best_of = raw.get("best_of") or {}
    for group, node in best_of.items():
        unknown = [a for a in node.get("arms") or [] if a not in arms]
        if unknown or len(node.get("arms") or []) < 2:
            raise UserError(f"{where}: best_of.{group}.arms", f"needs >= 2 of the study's arms (unknown: {unknown})",
                            list(arms))
        # the pick compares the candidates' means: over different seeds, an extra seed could decide it
        if len({frozenset(arms[a].extra_seeds) - set(raw.get("seeds") or [1]) for a in node["arms"]}) > 1:
            raise UserError(f"{where}: best_of.{group}.arms", "its arms must have the same extra_seeds (the pick "
                            "compares their means over the same seeds)")
        node.setdefault("by", "valid_bleu")
    return best_of


def _budget(raw: dict, name: str, budget: str, budgets: dict) -> tuple[list, list[str]]:
    """(seeds, overrides) of the budget: the study's own at full; a smaller budget's seeds, and its
    overrides after SMOKE's at smoke (a machinery test, never a result)."""
    if budget not in ("full", *budgets, "smoke"):
        raise UserError("study.budget", f"{budget!r} is not a budget of {name}", list(dict.fromkeys(["full", "smoke", *budgets])))
    seeds = raw.get("seeds") or [1]
    extra: list[str] = []
    if budget != "full":
        b = budgets.get(budget) or {}
        seeds = b.get("seeds") or ([1, 2] if budget == "smoke" else seeds)
        extra = (SMOKE if budget == "smoke" else []) + list(b.get("overrides") or [])
    return seeds, extra


def _kind(raw: dict, where: str, arms: dict[str, Arm], budget: str, budgets: dict) -> tuple[str, dict]:
    """(kind, probe settings): a probe study (normlab.study.probe) needs its depths, runs every arm at
    the study's seeds, and at a smaller budget takes the budget's `probe:` (default: 2 and 4 layers,
    d_model 32)."""
    kind = str(raw.get("kind") or "train")
    if kind not in ("train", "probe"):
        raise UserError(f"{where}: kind", f"{kind!r} is not a study kind", ["train", "probe"])
    probe = dict(raw.get("probe") or {})
    if kind == "probe":
        if not probe.get("depths"):
            raise UserError(f"{where}: probe.depths", "missing")
        if any(a.extra_seeds for a in arms.values()):  # a probe is cheap: every arm runs the study's seeds
            raise UserError(f"{where}: arms.<arm>.extra_seeds", "not for a probe study (give the study more seeds)")
        if budget != "full":
            probe.update((budgets.get(budget) or {}).get("probe") or {"depths": [2, 4], "d_model": 32})
    return kind, probe


def _screen(raw: dict, budget: dict, where: str, seeds, kind: str) -> Screen | None:
    """The study's screen (study/screen.py), with the budget's own `screen:` keys over it (a smoke
    budget screens a 2-value grid at tiny rungs)."""
    node = raw.get("screen")
    if node and kind == "probe":
        raise UserError(f"{where}: screen", "a probe study trains nothing to screen")
    if node and isinstance(node, dict) and isinstance(budget.get("screen"), dict):
        node = {**node, **budget["screen"]}
    return load_screen(node, where, [int(s) for s in seeds])


def _number(node: dict, key: str, where: str, low: float, high: float = float("inf"), integer: bool = False):
    if node.get(key) is None:
        raise UserError(f"{where}.{key}", "missing")
    v = node[key]
    ok = isinstance(v, int if integer else (int, float)) and not isinstance(v, bool) and low <= v <= high
    if not ok:
        span = f">= {low:g}" if high == float("inf") else f"in [{low:g}, {high:g}]"
        raise UserError(f"{where}.{key}", f"{v!r}: must be {'an integer' if integer else 'a number'} {span}")
    return v


def _keys(node, where: str, allowed: tuple[str, ...]) -> dict:
    if not isinstance(node, dict):
        raise UserError(where, f"must be a mapping of {', '.join(allowed)} (got {node!r})")
    for key in node:
        if key not in allowed:
            raise UserError(f"{where}.{key}", "not a key here", allowed)
    return node


def _judging(raw: dict, where: str, arms: dict[str, Arm]) -> dict:
    """reference, trains_bar and plateau: how claims.py judges "trains" and "budget-bound"."""
    reference, bar, plateau = raw.get("reference"), raw.get("trains_bar"), raw.get("plateau")
    if reference is not None and reference not in arms:
        raise UserError(f"{where}: reference", f"{reference!r} is not an arm", list(arms))
    if bar is not None and reference is None:
        raise UserError(f"{where}: reference", "missing: trains_bar measures an arm against the reference arm")
    out: dict = {"reference": reference}
    if reference is not None:
        bar = _keys({} if bar is None else bar, f"{where}: trains_bar", ("valid_nll", "test_bleu_ratio"))
        default = TrainsBar()
        out["trains_bar"] = TrainsBar(
            valid_nll=float(_number(bar, "valid_nll", f"{where}: trains_bar", 0.0) if "valid_nll" in bar else default.valid_nll),
            test_bleu_ratio=float(_number(bar, "test_bleu_ratio", f"{where}: trains_bar", 0.0, 1.0)
                                  if "test_bleu_ratio" in bar else default.test_bleu_ratio))
    if plateau is not None:
        at = f"{where}: plateau"
        plateau = _keys(plateau, at, ("window", "min_delta", "cap"))
        out["plateau"] = Plateau(window=_number(plateau, "window", at, 1, integer=True),
                                 min_delta=float(_number(plateau, "min_delta", at, 0.0)),
                                 cap=_number(plateau, "cap", at, 1, integer=True))
    return out
