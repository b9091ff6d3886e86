"""Console scripts (pyproject's [project.scripts]): `normlab-<command>` is
`python -m normlab.commands.<command>`, with the same one-line errors (exit status 2)."""
from __future__ import annotations

import importlib


def _run(command: str) -> None:
    from normlab.commands.common import main_guard
    from normlab.errors import invoked_as

    invoked_as("normlab-" + command.replace("_", "-"))

    raise SystemExit(main_guard(importlib.import_module(f"normlab.commands.{command}").main))


def train() -> None:
    from normlab.commands.train import cli

    cli()


def translate() -> None:
    _run("translate")


def evaluate() -> None:
    _run("evaluate")


def average() -> None:
    _run("average")


def prune() -> None:
    _run("prune")


def report() -> None:
    _run("report")


def export_admin() -> None:
    _run("export_admin")


def preprocess() -> None:
    _run("preprocess")


def study() -> None:
    _run("study")


def runs() -> None:
    _run("runs")
