"""A study's verdicts in W&B: one table (wandb.Table) per study, logged to a W&B run of the study's own
group (identity.study_group: study-<name>, study-<name>-smoke), so the dashboard shows the verdict
table beside the runs it judges. Logged when the study's runs log to W&B (their composed config has
logger.wandb: the default), in the runs' mode (offline unless set online: normlab/loggers.py), into
<runs>/wandb/ beside the run folders. The run's id follows from the group, so each time the study
writes its README the table is logged again into the same W&B run (offline: one more folder for it,
uploaded together by `wandb sync --id`)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from normlab.identity import study_group
from normlab.study.claims import Verdict
from normlab.study.spec import Study

COLUMNS = ("id", "claim", "verdict", "better", "than", "metric", "difference", "low", "high", "method",
           "paper_effect", "note")


def verdict_rows(verdicts: list[Verdict]) -> list[list]:
    """The README's verdict table as rows of COLUMNS (claims.json's values: the difference better − than
    and its seed-level interval, None where no interval was computed)."""
    rows = []
    for v in verdicts:
        d = v.as_dict()
        diff = d["difference"] or {}
        rows.append([d["id"], d["claim"], d["verdict"], d["better"], d["than"], d["metric"], diff.get("mean"),
                     diff.get("low"), diff.get("high"), diff.get("method"), d["paper_effect"], d["note"]])
    return rows


def log_verdicts(study: Study, verdicts: list[Verdict], cfg, runs: Path) -> str | None:
    """Log the verdict table; `cfg`: a study run's composed config (its loggers and W&B project). The
    offline run's line (where it is, how to sync it), or None when nothing was logged."""
    node = (cfg.get("logger") or {}).get("wandb")
    if node is None or not verdicts:
        return None
    import wandb

    from normlab.loggers import build_loggers, finish_loggers, offline_note

    group = study_group(study.name, study.budget)
    run_id = hashlib.sha256(f"verdicts:{group}".encode()).hexdigest()[:16]
    (logger,) = build_loggers({"wandb": node}, runs, str(cfg.project), f"{group}-verdicts", group,
                              [f"study:{study.name}", f"budget:{study.budget}", "verdicts"],
                              config={"labels": {"study": study.name, "budget": study.budget}}, run_id=run_id)
    run = logger.experiment
    run.log({"verdicts": wandb.Table(columns=list(COLUMNS), data=verdict_rows(verdicts))})
    note = offline_note(run)
    finish_loggers([logger], {"status": "completed"})
    return note or f"W&B: the verdict table is in the run {group}-verdicts of group {group}"
