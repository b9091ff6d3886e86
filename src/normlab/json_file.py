"""A JSON file that should hold an object (a run's run.json and results.json, a study's records),
read so that a damaged one is named, not a traceback: cut off, empty, not UTF-8, not JSON, or valid
JSON that is not an object (a list, a string). Its readers decide what a damaged file means to them
(run_folder.py: treated as missing; study/damaged.py: not recorded, left as it is).
"""
from __future__ import annotations

import json
from pathlib import Path


def json_kind(value) -> str:
    """What a JSON value is, in words ("a JSON list")."""
    kinds = {list: "a JSON list", str: "a JSON string", bool: "true/false", type(None): "null"}
    return kinds.get(type(value), "a JSON number" if isinstance(value, (int, float)) else type(value).__name__)


def json_object(path: Path) -> tuple[dict | None, str | None]:
    """(the file's JSON object, None), (None, what is wrong with it), or (None, None) when it is absent."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    if not data.strip():
        return None, "empty"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not text (not UTF-8 at byte {e.start})"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
            return None, f"not JSON (cut off at byte {len(data)}?)"
        return None, f"not JSON (line {e.lineno} column {e.colno}: {e.msg})"
    if not isinstance(value, dict):
        return None, f"{json_kind(value)}, not a JSON object"
    return value, None
