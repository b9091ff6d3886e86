"""What `normlab-study NAME --verify RUN` reads from a record, checked before any work (before a
temporary folder or a code export): results.json's fields the rerun is built from (study.overrides,
study.jobs, device, cpu, code, code_legs) and the training losses of metrics.csv. A damaged record
is refused in one line, `error: <file>: <key>: <what> (allowed: ...)` (metrics.csv: `<file>:<line>`),
never a traceback half-way through a rerun.
"""
from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

from normlab.errors import UserError

LOSSES = ("train/loss", "train/nll")  # what training logs (lit_module.training_step), compared as written
_COMMIT = re.compile(r"[0-9a-fA-F]{7,40}")  # provenance.code_version: git rev-parse HEAD


def _count(low: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


# a field's form: (what is allowed, its test, its JSON type: a value of that type that fails the
# test "is not" what is allowed, one of another type "is" its type)
_STRING = ("a string", lambda v: isinstance(v, str), str)
_FLAG = ("true or false", lambda v: isinstance(v, bool), bool)
_COMMIT_FORM = ("a git commit (hex)", lambda v: isinstance(v, str) and _COMMIT.fullmatch(v) is not None, str)
_CODE = {"commit": _COMMIT_FORM, "dirty": _FLAG, "torch": _STRING}
_LEG = {"commit": _COMMIT_FORM, "dirty": _FLAG, "from_step": ("a whole number >= 0", _count(0), int)}
# results.json's top-level fields the rerun reads, each optional (null or absent: not recorded)
_FIELDS = {"device": _STRING, "identity_hash": _STRING}
_CPU = {k: _STRING for k in ("model", "isa", "capability", "mkl", "onednn")}


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value) -> str:
    if isinstance(value, bool):
        return "true/false"
    return {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _bad(where: str, key: str, value, allowed: str, form: tuple | None = None) -> UserError:
    """`<file>: <key>: <value> is <its type> (allowed: ...)`, or `... is not <form>` for a value of
    the form's type."""
    if form is not None and isinstance(value, form[2]) and isinstance(value, bool) == (form[2] is bool):
        what = f"{_shown(value)} is not {form[0]}"
    else:
        what = f"{_shown(value)} is {_kind(value)}" if not isinstance(value, (dict, list)) else _kind(value)
    return UserError(f"{where}: {key}", what, allowed)


def _check_fields(where: str, prefix: str, obj: dict, forms: dict) -> None:
    """Each field of `forms` in `obj`: absent, null or of its form."""
    for key, form in forms.items():
        value = obj.get(key)
        if value is not None and not form[1](value):
            raise _bad(where, prefix + key, value, f"{form[0]}, or null", form)


def _object(where: str, key: str, value, allowed: str = "an object, or null") -> dict:
    if value is not None and not isinstance(value, dict):
        raise _bad(where, key, value, allowed)
    return value or {}


def _check_study(where: str, res: dict) -> None:
    study = _object(where, "study", res.get("study"), "an object with overrides, as the study writes it")
    overrides = study.get("overrides")
    if overrides is not None and not isinstance(overrides, list):
        raise _bad(where, "study.overrides", overrides, "a list of train.py settings, key=value")
    for i, item in enumerate(overrides or []):
        if not isinstance(item, str):
            raise _bad(where, f"study.overrides[{i}]", item, "a train.py setting, key=value")
    _check_fields(where, "study.", study, {"jobs": ("a whole number >= 1", _count(1), int)})


def _check_code(where: str, res: dict) -> None:
    _check_fields(where, "code.", _object(where, "code", res.get("code")), _CODE)
    legs = res.get("code_legs")
    if legs is not None and not isinstance(legs, list):
        raise _bad(where, "code_legs", legs, "a list of {commit, dirty, from_step}, or null")
    for i, leg in enumerate(legs or []):
        key = f"code_legs[{i}]"
        if not isinstance(leg, dict):
            raise _bad(where, key, leg, "an object {commit, dirty, from_step}")
        _check_fields(where, key + ".", leg, _LEG)


def check_results(res, where: str) -> dict:
    """results.json as read (`res`): the record, or UserError naming the first field --verify cannot
    use."""
    if not isinstance(res, dict):
        raise UserError(where, f"{_kind(res)}, not a record", "a JSON object, as training writes results.json")
    _check_study(where, res)
    _check_fields(where, "", res, _FIELDS)
    _check_fields(where, "cpu.", _object(where, "cpu", res.get("cpu")), _CPU)
    _check_code(where, res)
    return res


def read_results(path: Path) -> dict:
    try:
        res = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}", f"not a readable record: {e}") from None
    return check_results(res, str(path))


def _text(metrics: Path) -> str:
    data = metrics.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{metrics}:{line}", f"byte 0x{data[e.start]:02x} is not UTF-8 text",
                        "UTF-8 text, as training's CSV logger writes it") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def logged_losses(metrics: Path) -> dict[int, dict[str, str]]:
    """{step: {"train/loss": "8.3657...", ...}} as the CSV logger wrote them (step: metrics.csv's, the
    optimizer steps done before it). Strings: a float32 written by the same logger is the same text
    exactly when it is the same number. A file that is not the logger's CSV (not UTF-8, a loss that
    is not a number): UserError at its line."""
    out: dict[int, dict[str, str]] = {}
    reader = csv.DictReader(io.StringIO(_text(metrics), newline=""))
    try:
        for row in reader:
            vals = {k: row[k] for k in LOSSES if row.get(k) not in (None, "")}
            for key, text in vals.items():
                if not isinstance(text, str) or not _is_number(text):
                    raise UserError(f"{metrics}:{reader.line_num}", f"{key}: {_shown(text)} is not a number",
                                    "a number, or empty")
            if vals and str(row.get("step", "")).isdigit():
                out[int(row["step"])] = vals
    except csv.Error as e:
        raise UserError(f"{metrics}:{reader.line_num}", f"not CSV: {e}") from None
    return out
