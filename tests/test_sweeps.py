"""Every sweep file (sweeps/*.yaml) and experiment preset (conf/experiment/*.yaml) composes and
runs one tiny step (lightning-hydra-template's fast-dev-run pattern). Parametrized over the files
on disk, so a new sweep or preset is covered without touching this file."""
import functools
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from normlab.run_config import validate_run_config
from normlab.train import run

from conftest import CONF, ROOT, compose_cfg, tiny_overrides

SWEEPS = sorted(p.stem for p in (ROOT / "sweeps").glob("*.yaml"))
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
# One step on CPU whatever the preset's trainer; an untrained model never emits EOS, so decoding is
# capped at 5 tokens (beam 4 over |src| + 50 steps would dominate the test's time); the paper
# models' 1024 positions would not fit the tiny runs' data.max_tokens=512 (config check).
CPU = ["model.max_positions=256", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.strategy=auto",
       "trainer.precision=32-true",
       "trainer.max_steps=1", "trainer.val_check_interval=1", "callbacks.step_checkpoints.every_n_steps=1",
       "eval.decoder.max_len_a=0", "eval.decoder.max_len_b=5", "eval.test_decoder.max_len_a=0",
       "eval.test_decoder.max_len_b=5", "optim.tokens_per_update=null"]


def tiny(small_corpus, tmp_path) -> list[str]:
    return tiny_overrides(small_corpus, tmp_path / "run", tmp_path.parent / "cache") + CPU


def compose_with_hydra(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


@functools.lru_cache(maxsize=None)
def sweep_params(name: str) -> tuple[str, dict]:
    cfg = compose_with_hydra([f"+sweep={name}"])
    return cfg.hydra.sweeper._target_, OmegaConf.to_container(cfg.hydra.sweeper.params or {})


def basic_combinations(params: dict) -> list[list[str]]:
    """Jobs of the basic sweeper in which every value of every axis appears at least once (job i takes
    value i of each axis, cycling): the full cartesian product composes too slowly for a fast test.
    Seeds are left out: they never change composition."""
    parser = OverridesParser.create()
    axes = []
    for key, value in params.items():
        o = parser.parse_override(f"{key}={value}")
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        if key != "seed":
            axes.append([f"{key}={v}" for v in values])
    n = max(map(len, axes), default=1)
    return [[axis[i % len(axis)] for axis in axes] for i in range(n)]


def optuna_combination(params: dict) -> list[str]:
    """One point of the Optuna search space, asked from the installed optuna (checks the syntax)."""
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    space, fixed = create_params_from_overrides([f"{k}={v}" for k, v in params.items()])
    assert space, "an Optuna sweep needs a search space"
    trial = optuna.create_study(direction="maximize").ask(space)
    return [f"{k}={v}" for k, v in {**trial.params, **fixed}.items()]


def first_job(name: str) -> list[str]:
    target, params = sweep_params(name)
    if "optuna" in target.lower():
        return optuna_combination(params)
    return basic_combinations(params)[0]


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_file_every_value_composes(name, small_corpus, tmp_path):
    target, params = sweep_params(name)
    assert params, f"sweeps/{name}.yaml has no hydra.sweeper.params"
    jobs = [optuna_combination(params)] if "optuna" in target.lower() else basic_combinations(params)
    for job in jobs:  # Hydra composes its own node too; validation never reads it, so it is left out
        cfg = compose_cfg([f"+sweep={name}", *tiny(small_corpus, tmp_path), *job])
        validate_run_config(cfg)  # e.g. init=admin with a pre-norm arm would fail here


@pytest.mark.integration
@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_file_runs_one_tiny_step(name, small_corpus, tmp_path):
    results = run(compose_cfg([f"+sweep={name}", *tiny(small_corpus, tmp_path), *first_job(name)]))
    assert results["status"] == "completed" and results["steps"] == 1, results
    assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "completed"


@functools.lru_cache(maxsize=None)
def _presets_run_by_a_sweep() -> set[str]:
    used = set()
    for name in SWEEPS:
        cfg = compose_with_hydra([f"+sweep={name}"])
        used.add(cfg.hydra.runtime.choices.get("experiment"))
    return used


@pytest.mark.integration
@pytest.mark.parametrize("name", PRESETS)
def test_experiment_preset_runs_one_tiny_step(name, small_corpus, tmp_path):
    overrides = [f"experiment={name}", *tiny(small_corpus, tmp_path)]
    cfg = compose_with_hydra(overrides)
    validate_run_config(cfg)
    if name in _presets_run_by_a_sweep():
        pytest.skip(f"experiment={name} runs in the tiny step of the sweep file that selects it")
    results = run(compose_cfg(overrides))
    assert results["status"] == "completed" and results["steps"] == 1, results
