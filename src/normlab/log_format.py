"""The console's log lines: `[HH:MM:SS] message`, warnings and errors marked as such.

Hydra's default prefix, `[2026-11-24 07:17:20,137][normlab][INFO] - `, takes ~45 characters of
every console line; the run's text log (<run>/<job>.log) keeps it in full (conf/hydra/default.yaml
sets this formatter on the console handler only). Light on purpose: Hydra builds it before the job,
and a bad override must be reported before Lightning is imported.
"""
from __future__ import annotations

import logging


class ConsoleFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if record.levelno >= logging.WARNING:  # "[07:17:20] warning: ..." (the level a user acts on)
            stamp, _, text = line.partition("] ")
            line = f"{stamp}] {record.levelname.lower()}: {text}"
        return line
