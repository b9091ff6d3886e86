"""The study package reads as named steps (issue 37 item 5): no function in src/normlab/study/ or in
the study command is longer than MAX_LINES, so each fits on a screen and does one thing (plan, run,
judge, write). The detector is also run on snippets that break the rule, so the rule can fail.
"""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "normlab"
MAX_LINES = 60  # design.md: a function fits on one screen
FILES = sorted((SRC / "study").glob("*.py")) + [SRC / "commands" / "study.py"]


def long_functions(source: str, limit: int = MAX_LINES) -> list[str]:
    """`name (N lines from line L)` for each function or method, nested ones included, longer than
    `limit` lines, counted from its first decorator (or `def`) to its last line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = node.end_lineno - start + 1
            if lines > limit:
                found.append(f"{node.name} ({lines} lines from line {start})")
    return found


def test_no_study_function_is_longer_than_a_screen():
    assert len(FILES) > 10 and all(p.is_file() for p in FILES)  # the walk finds the package
    too_long = {p.relative_to(SRC.parent).as_posix(): long_functions(p.read_text(encoding="utf-8")) for p in FILES}
    too_long = {k: v for k, v in too_long.items() if v}
    assert not too_long, f"split these into named steps (at most {MAX_LINES} lines each): {too_long}"


def _function(name: str, body_lines: int, indent: str = "", decorator: bool = False) -> str:
    head = [f"{indent}@staticmethod"] if decorator else []
    return "\n".join([*head, f"{indent}def {name}():", *[f"{indent}    x = {i}" for i in range(body_lines)]]) + "\n"


@pytest.mark.parametrize("snippet, hits", [
    (_function("fits", MAX_LINES - 1), []),                                   # def + 59 lines: 60, allowed
    (_function("too_long", MAX_LINES), ["too_long (61 lines from line 1)"]),  # def + 60 lines: 61
    ("class A:\n" + _function("method", MAX_LINES, "    "), ["method (61 lines from line 2)"]),
    ("class A:\n" + _function("decorated", MAX_LINES - 1, "    ", decorator=True), ["decorated (61 lines from line 2)"]),
    ("def outer():\n" + _function("inner", MAX_LINES, "    ") + "    return inner\n",
     ["outer (63 lines from line 1)", "inner (61 lines from line 2)"]),
    ("async " + _function("coroutine", MAX_LINES), ["coroutine (61 lines from line 1)"]),
])
def test_the_long_function_detector_finds_what_it_must(snippet, hits):
    assert long_functions(snippet) == hits
