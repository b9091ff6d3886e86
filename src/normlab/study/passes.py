"""The scoring passes a study's runs make that nothing of the study reads (issue 36: a study scores
only what its claims read).

A run's final passes (final_test.py) each give a few results.json keys, and an arm's prune command
(commands/prune.py) a valid and a test decode per pruned model; a study reads the metrics of its
claims (`metric`, `than_metric`), its table (`table_metrics`), its best_of picks (`by`) and its
screen (`by`). A pass none of whose metrics is read is listed here, so its cost can be cut with the
study's `common` overrides (eval.test_greedy=false, eval.test_average=false, ...). Those overrides are
part of the runs' identities: turning a pass off in a study that has records makes new runs of them,
so this module only lists; a study's file decides. Validation BLEU during training is never listed:
the best checkpoint is chosen by it (callbacks.checkpoint; eval.valid_subset makes it cheaper).

    python -m normlab.study.passes [STUDY ...]     # every shipped study by default
"""
from __future__ import annotations

import sys

from normlab.study.spec import Arm, Study, available, load_study

SCORES = ("bleu", "chrf")
LOSSES = ("loss", "nll", "ppl")


def metrics_read(study: Study) -> set[str]:
    """Every results metric the study's verdicts, table, picks and screen read."""
    read = set(study.table_metrics)
    for c in study.claims:
        read.update(m for m in (c.metric, c.than_metric) if m)
    read.update(str(g.get("by") or "valid_bleu") for g in study.best_of.values())
    if study.screen is not None:
        read.add(study.screen.by)
    if study.reference is not None and any(c.kind == "trains" for c in study.claims):
        read.update(("valid_nll", "test_bleu"))  # the trains bar against the reference (claims.trains_bar)
    return read


def final_passes(cfg) -> dict[str, tuple[str, ...]]:
    """{pass: the results.json keys it gives} for the decoding passes a run of `cfg` makes at its end."""
    from omegaconf import OmegaConf

    from normlab.run_spec import FinalPasses
    from normlab.settings import EvalSpec

    ev = EvalSpec.of(OmegaConf.to_container(cfg.eval, resolve=True))
    keep = OmegaConf.select(cfg, "callbacks.step_checkpoints.keep_last_n", default=0)
    fp = FinalPasses.of(ev, keep)
    out: dict[str, tuple[str, ...]] = {}
    # without valid_bleu the final valid pass scores the loss only; a run whose best checkpoint is its last
    # validation's takes that validation's scores instead of decoding again (final_test.validated_scores)
    if ev.valid_bleu:
        out["final valid decode"] = tuple(f"valid_{m}" for m in SCORES)
    if fp.test:
        out["final test decode (beam)"] = tuple(f"test_{m}" for m in SCORES + LOSSES)
        if fp.greedy:
            out["final test greedy"] = tuple(f"test_{m}_greedy" for m in SCORES)
        if fp.average_last_n > 0:
            out["final test averaged"] = tuple(f"test_{m}_avg" for m in SCORES + LOSSES)
    return out


def prune_passes(arm: Arm, cfg) -> dict[str, tuple[str, ...]]:
    """{pass: metrics} of the arm's prune command: a valid and a test decode of the unpruned model
    (prune.full.r<depth>) and of each pruned one (prune.<strategy>.r<kept>) that has layers to keep."""
    if not arm.prune:
        return {}
    enc, dec = int(cfg.model.encoder_layers), int(cfg.model.decoder_layers)
    learned = str(cfg.regularizer.get("layerdrop_rates", "")) == "learned"
    models = [("full", max(enc, dec))]
    models += [(s, int(r)) for s in arm.prune.get("strategies") or [] for r in arm.prune.get("depths") or []
               if int(r) < max(enc, dec) and (s != "data_driven" or learned)]  # else a row without scores
    return {f"prune {s} r{r} {split} decode": (f"prune.{s}.r{r}.{split}_bleu",)
            for s, r in models for split in ("valid", "test")}


def unread_passes(study: Study) -> dict[str, list[str]]:
    """{pass: the arms whose runs make it while the study reads none of its metrics}, composed from
    each arm's overrides at its first seed (the seed changes no pass)."""
    from normlab.study.plan import compose

    if study.kind != "train":
        return {}
    read = metrics_read(study)
    out: dict[str, list[str]] = {}
    for arm in study.arms.values():
        cfg = compose(study.arm_overrides(arm, study.seeds_of(arm)[0]))
        for name, metrics in {**final_passes(cfg), **prune_passes(arm, cfg)}.items():
            if not read.intersection(metrics):
                out.setdefault(name, []).append(arm.name)
    return out


def main(argv: list[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or available()
    for name in names:
        unread = unread_passes(load_study(name))
        print(f"{name}: " + ("every pass is read" if not unread else "; ".join(
            f"{p} ({', '.join(arms)})" for p, arms in unread.items())))
    return 0


if __name__ == "__main__":
    from normlab.commands.common import main_guard

    raise SystemExit(main_guard(main))
