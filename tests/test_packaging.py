"""Packaging: a console script per command (and `python -m` still works), every documented feature in
the default install, versions pinned to what the tests passed with, Optuna's sqlite storage."""
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPTS = {"normlab-train": "normlab.cli:train", "normlab-translate": "normlab.cli:translate",
           "normlab-evaluate": "normlab.cli:evaluate", "normlab-average": "normlab.cli:average",
           "normlab-prune": "normlab.cli:prune", "normlab-report": "normlab.cli:report",
           "normlab-export-admin": "normlab.cli:export_admin", "normlab-preprocess": "normlab.cli:preprocess",
           "normlab-study": "normlab.cli:study", "normlab-runs": "normlab.cli:runs"}
BIN = Path(sys.executable).parent


def test_a_console_script_per_command():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == SCRIPTS
    installed = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts") if ep.name in SCRIPTS}
    assert installed == SCRIPTS  # make install put them on PATH (.venv/bin)
    for target in SCRIPTS.values():
        module, func = target.split(":")
        assert callable(getattr(__import__(module, fromlist=[func]), func))


@pytest.mark.integration
def test_scripts_and_python_m_run(tmp_path):
    bad = subprocess.run([str(BIN / "normlab-train"), "norm=sideways"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: norm=sideways: no such norm option")
    missing = subprocess.run([str(BIN / "normlab-translate"), str(tmp_path / "none.ckpt")], input="", text=True,
                             capture_output=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr == f"error: {tmp_path / 'none.ckpt'}: no such checkpoint file or run folder\n"
    help_ = subprocess.run([sys.executable, "-m", "normlab.commands.average", "--help"], capture_output=True,
                           text=True, timeout=120)
    assert help_.returncode == 0 and "--last" in help_.stdout


def test_readme_features_are_in_the_default_install():
    deps = " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    for package in ("wandb", "tensorboard", "matplotlib", "hydra-optuna-sweeper", "sacrebleu", "sentencepiece"):
        assert re.search(rf"\b{package}\b", deps), package


def test_installed_versions_are_the_pinned_ones():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert not {k.lower() for k in pins} & {"torch", "normlab"}  # never pin the user's torch
    assert {"lightning", "hydra-core", "wandb", "optuna", "sqlalchemy"} <= {k.lower() for k in pins}
    wrong = {name: (version, metadata.version(name)) for name, version in pins.items()
             if metadata.version(name) != version}
    assert not wrong, f"installed versions differ from constraints.txt (run make install): {wrong}"


def test_optuna_sqlite_storage(tmp_path):
    """The sweeper's documented `hydra.sweeper.storage=sqlite:///optuna.db` (optuna 2.10 failed on
    SQLAlchemy 2): a study written to sqlite, reloaded from it, and continued."""
    import optuna

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
    study.optimize(lambda t: -(t.suggest_float("x", -1, 1) - 0.5) ** 2, n_trials=3)
    again = optuna.load_study(study_name="s", storage=storage)
    again.optimize(lambda t: -(t.suggest_float("x", -1, 1) - 0.5) ** 2, n_trials=2)
    assert len(optuna.load_study(study_name="s", storage=storage).trials) == 5
