"""Plan a study: every (arm, seed) it trains, each a `Job` whose config is composed as train.py composes
it, validated, and named as the run names itself (run_identity.identify), before anything runs. The
first of the study's steps: plan (here) -> run (runner.py, screen_run.py) -> judge (claims.py, the
formulas in stats.py) -> write (readme.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from normlab.errors import UserError
from normlab.study.spec import Arm, Study


@dataclass
class Job:
    arm: Arm
    seed: int
    overrides: list[str]
    run_name: str
    identity_hash: str
    run_dir: Path
    record: Path
    stop_at: int | None = None  # a screen's rung: train to this step and pause (study/screen_run.py)
    labels: tuple[str, ...] = ()  # labels.study / arm / budget: what the run is part of (not its identity)

    @property
    def tag(self) -> str:
        return f"{self.arm.name} seed {self.seed}"


def compose(overrides: list[str]):
    """The config train.py would run with these overrides (Hydra's compose API), validated."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from normlab.commands.train import config_dir, hydra_error_line
    from normlab.private_api import reset_hydra
    from normlab.run_config import validate_run_config

    reset_hydra()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except Exception as e:  # a bad override in the study file: one line naming it
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(e, (HydraException, OmegaConfBaseException)):
            raise UserError(hydra_error_line(e, overrides)) from None
        raise
    finally:
        reset_hydra()
    validate_run_config(cfg)
    return cfg


def plan(study: Study, runs: Path, out: Path, chosen: dict[str, list[str]] | None = None) -> list[Job]:
    """Every (arm, seed) of the study with its run folder and record, composed and checked before
    anything runs. A screened arm runs at the setting its screen chose (`chosen`: arm -> overrides,
    study/screen_run.py) and is left out until it has one."""
    chosen = chosen or {}
    jobs = []
    for seed in study.all_seeds:  # seed-major: a partial study has whole seeds of every arm
        for arm in (a for a in study.arms.values() if seed in study.seeds_of(a)):
            if study.screened(arm) and arm.name not in chosen:
                continue
            overrides = study.arm_overrides(arm, seed) + list(chosen.get(arm.name, []))
            jobs.append(make_job(study, arm, seed, overrides, runs, out / "runs" / f"{arm.name}-s{seed}"))
    return jobs


def study_labels(study: Study, arm: Arm) -> tuple[str, ...]:
    """The overrides that say which study, arm and budget a run is part of (the config's `labels`):
    its W&B group (identity.study_group) and tags, results.json's labels and the report's rows read
    them. Not part of the run's identity, so a run two studies share is one run. Quoted: an arm named
    `none` or `1e-3` is that text, not Hydra's value."""
    return tuple(f"labels.{k}='{v}'" for k, v in (("study", study.name), ("arm", arm.name), ("budget", study.budget)))


def make_job(study: Study, arm: Arm, seed: int, overrides: list[str], runs: Path, record: Path,
             stop_at: int | None = None) -> Job:
    """A run of the study: its config composed with its labels and validated (one line naming the arm
    if it is bad), its folder named by its identity as the run names it (run_identity.identify: a start
    checkpoint's model merged in; an existing folder of an older name is continued)."""
    from normlab.run_identity import Runtime, folder_name, identify

    labels = study_labels(study, arm)
    try:
        cfg = compose([*overrides, *labels])
    except UserError as e:
        raise UserError(f"{study.path.name}: arms.{arm.name}: {e}") from None
    ident = identify(cfg, Runtime(overrides=(*overrides, *labels), runs_dir=None))  # the command's typed keys
    name = folder_name(ident, runs)  # the train command passes it as hydra.run.dir
    return Job(arm, seed, overrides, name, ident.hash, runs / name, record, stop_at, labels)
