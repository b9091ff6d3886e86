"""Bad input is the user's to fix: one line, `error: <key or file:line>: <what> (allowed: ...)`.

Every entry point (train.py, the commands) prints a `UserError` as that one line and exits with
status 2, without a traceback; anything else is a bug and keeps its traceback. Set
NORMLAB_TRACEBACK=1 (or HYDRA_FULL_ERROR=1) to see the traceback of a user error too.
"""
from __future__ import annotations

import argparse
import os
import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An input the user must fix; str() is `<where>: <what> (allowed: ...)`."""

    def __init__(self, where: str, what: str | None = None, allowed=None):
        msg = where if what is None else f"{where}: {what}"
        if allowed:
            msg += f" (allowed: {allowed if isinstance(allowed, str) else ', '.join(map(str, allowed))})"
        super().__init__(msg)


_console_script: str | None = None  # the normlab-<command> script running this process (normlab.cli)


def invoked_as(script: str) -> None:
    """normlab.cli: this process is the console script `script`, so a usage line names it, not
    `python -m normlab.commands.<command>` (passed in, rather than read from sys.argv deep inside)."""
    global _console_script
    _console_script = script


class CommandParser(argparse.ArgumentParser):
    """argparse that reports a bad flag like every other user error: one line, exit status 2; its
    usage line names the command as it was called (normlab-translate, or python -m ...)."""

    def __init__(self, *args, prog: str | None = None, **kwargs):
        if prog and prog.startswith("python -m normlab.commands.") and _console_script:
            prog = _console_script
        super().__init__(*args, prog=prog, **kwargs)

    def error(self, message: str):
        raise UserError(self.prog, f"{message} (see {self.prog} --help)")


def user_error_types() -> tuple[type[BaseException], ...]:
    """The one family of user errors (CorpusError, ConfigError, CheckpointError, CommandError, ...
    are UserErrors)."""
    return (UserError,)


def show_tracebacks() -> bool:
    return any(os.environ.get(k, "") not in ("", "0") for k in ("NORMLAB_TRACEBACK", "HYDRA_FULL_ERROR"))


def one_line(err: BaseException) -> str:
    """The message on one line (a multi-line message is joined with '; ')."""
    text = "; ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return f"error: {text or type(err).__name__}"


def report(err: BaseException) -> int:
    """Print a user error as one line on stderr; the exit status for it."""
    print(one_line(err), file=sys.stderr)
    return EXIT_USER_ERROR
