"""Which tests are integration tests (issue 37 item 10), decided from the test files' source by one
rule, not picked by hand: a test is integration when it trains or runs a command through the entry
point, itself, through a helper it calls or through a fixture it requests. tests/test_pyramid.py
holds every test file to it; `make test-fast` leaves these tests out.

A function enters the entry point when its body (nested functions and lambdas included)
- names, in this process, what trains: normlab.train.run or run_resolved, normlab.commands.train's main, task or
  cli, normlab.commands.study's main or cli, normlab.cli's train or study (the console scripts), or
  calls run() on a study runner's Sweep (it starts the training processes);
- or starts a process (subprocess.run, Popen, call, check_call, check_output) and names a normlab
  command in the same function: train.py, a console script of pyproject.toml (normlab-train, ...),
  a module normlab.commands.<cmd> (`python -m`) or a benchmark script that trains through the entry
  point (TRAINING_BENCHMARKS), as a string or a module-level constant;
- or calls (or hands on) a function of its file, or of a test file it imports, that enters;
- or requests a fixture that enters.
Other commands run in this process (translate, prune, report on a checkpoint) are unit-scale and
stay unit tests; a `python -c` child that imports normlab is not a command. The rule reads the
test functions at a file's top level (the suite has no test classes; test_pyramid.py checks that).
"""
from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MARK = "integration"
ENTRY = {"normlab.train.run", "normlab.train.run_resolved", "normlab.commands.train.main", "normlab.commands.train.task",
         "normlab.commands.train.cli", "normlab.commands.study.main", "normlab.commands.study.cli",
         "normlab.cli.train", "normlab.cli.study"}
SWEEP = "normlab.study.runner.Sweep"
SPAWN = {f"subprocess.{f}" for f in ("run", "Popen", "call", "check_call", "check_output")}
SCRIPTS = frozenset(tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["scripts"])
# The scripts of benchmarks/ that train through the entry point, by the shell or the processes they start
# (gpu_check.sh --dry-run: its part b is `train.py trainer=gpu`, normlab.train.run in a part's process):
# a test that runs one runs a command that trains. tests/test_pyramid.py checks that each listed script
# reaches the entry point and that each one a test runs as a process and that reaches it is listed.
TRAINING_BENCHMARKS = frozenset({"gpu_check.sh"})


def names_command(text: str) -> bool:
    """train.py, a console script or a training benchmark script (a path may lead to any), or a
    `python -m` command module."""
    last = text.rsplit("/", 1)[-1]
    return (last == "train.py" or last in SCRIPTS or last in TRAINING_BENCHMARKS
            or re.fullmatch(r"normlab\.commands\.\w+", text) is not None)


@dataclass
class Func:
    name: str
    line: int
    params: tuple[str, ...]  # the fixtures it requests (its arguments and usefixtures)
    reasons: list[str]  # why it enters by itself
    uses: set[str]  # the functions it calls or hands on, qualified ("helper", "test_study.run_study")
    fixture: str | None = None  # the fixture name, when it is one
    autouse: bool = False
    marked: bool = False  # @pytest.mark.integration


@dataclass
class Module:
    name: str
    funcs: dict[str, Func] = field(default_factory=dict)
    bindings: dict[str, str] = field(default_factory=dict)  # module-level imports: name -> qualified
    marked: bool = False  # pytestmark holds pytest.mark.integration
    classes: list[str] = field(default_factory=list)  # Test* classes (the rule does not read them)

    @property
    def tests(self) -> list[Func]:
        return [f for f in self.funcs.values() if f.name.startswith("test") and f.fixture is None]

    @property
    def fixtures(self) -> dict[str, Func]:
        return {f.fixture: f for f in self.funcs.values() if f.fixture}


def imports(nodes) -> dict[str, str]:
    out = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def qualify(expr: ast.expr, bindings: dict[str, str]) -> str | None:
    """`run` -> normlab.train.run when imported so; `study_cmd.main` -> normlab.commands.study.main."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return ".".join([bindings.get(expr.id, expr.id), *reversed(parts)])


def is_mark(expr: ast.expr, bindings: dict[str, str], mark: str) -> bool:
    return qualify(expr.func if isinstance(expr, ast.Call) else expr, bindings) == f"pytest.mark.{mark}"


def read_func(node: ast.FunctionDef, module: dict[str, str], commands: set[str]) -> Func:
    body = [n for stmt in node.body for n in ast.walk(stmt)]
    # a name the function binds itself (an argument, a nested def, an assignment) is not the import
    own = {a.arg for n in [node, *body] if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
           for a in [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs]}
    own |= {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {n.id for n in body if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local = imports(body)
    own -= local.keys()
    bindings = {**{k: v for k, v in module.items() if k not in own}, **local}
    reasons, uses, spawns, named, sweeps = [], set(), [], [], set()
    for n in body:
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and qualify(n.value.func, bindings) == SWEEP:
            sweeps |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    for n in body:
        if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Load):
            q = qualify(n, bindings)
            if q in ENTRY:
                reasons.append(f"{q} (line {n.lineno})")
            elif q is not None and not (isinstance(n, ast.Name) and n.id in own):  # a fixture's value is no call
                uses.add(q)
            if isinstance(n, ast.Name) and n.id in commands:
                named.append(n.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and names_command(n.value):
            named.append(repr(n.value))
        if isinstance(n, ast.Call):
            q = qualify(n.func, bindings)
            if q in SPAWN:
                spawns.append(f"{q} (line {n.lineno})")
            if isinstance(n.func, ast.Attribute) and n.func.attr == "run" and (
                    qualify(n.func.value.func, bindings) == SWEEP if isinstance(n.func.value, ast.Call)
                    else isinstance(n.func.value, ast.Name) and n.func.value.id in sweeps):
                reasons.append(f"{SWEEP}.run (line {n.lineno})")
    if spawns and named:
        reasons.append(f"{spawns[0]} of {named[0]}")
    func = Func(node.name, node.lineno, tuple(a.arg for a in [*node.args.args, *node.args.kwonlyargs]), reasons, uses)
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if qualify(target, bindings) == "pytest.fixture":
            kw = {k.arg: k.value for k in dec.keywords} if isinstance(dec, ast.Call) else {}
            func.fixture = kw["name"].value if isinstance(kw.get("name"), ast.Constant) else node.name
            func.autouse = isinstance(kw.get("autouse"), ast.Constant) and kw["autouse"].value is True
        func.marked |= is_mark(dec, bindings, MARK)
        if is_mark(dec, bindings, "usefixtures"):
            func.params += tuple(a.value for a in dec.args if isinstance(a, ast.Constant))
    return func


def read_module(name: str, source: str) -> Module:
    tree = ast.parse(source)
    mod = Module(name, bindings=imports(tree.body))
    commands = set()  # module-level names whose value names a command (a command line built once)
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(c, ast.Constant) and isinstance(c.value, str) and names_command(c.value)
                   for c in ast.walk(node.value)):
                commands |= names
            if "pytestmark" in names:
                mod.marked = any(is_mark(e, mod.bindings, MARK) for e in ast.walk(node.value)
                                 if isinstance(e, (ast.Attribute, ast.Call)))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            mod.classes.append(node.name)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mod.funcs[node.name] = read_func(node, mod.bindings, commands)
    return mod


@cache
def load(name: str) -> Module | None:
    path = TESTS / f"{name}.py"
    return read_module(name, path.read_text(encoding="utf-8")) if path.is_file() else None


def resolve(mod: Module, qualified: str, load=load) -> tuple[Module, Func] | None:
    """A function this module defines, or one of another test file (imported)."""
    if qualified in mod.funcs:
        return mod, mod.funcs[qualified]
    head, _, name = qualified.rpartition(".")
    other = load(head) if head and "." not in head else None
    return (other, other.funcs[name]) if other and name in other.funcs else None


def fixture_of(mod: Module, name: str, load=load) -> tuple[Module, Func] | None:
    """The fixture a test of `mod` gets for `name`: its own, one it imports, or conftest's."""
    if name in mod.fixtures:
        return mod, mod.fixtures[name]
    origin = mod.bindings.get(name, "")
    other = load(origin.rpartition(".")[0]) if origin.startswith("test") else None
    if other and name in other.fixtures:
        return other, other.fixtures[name]
    conftest = load("conftest") if mod.name != "conftest" else None
    return (conftest, conftest.fixtures[name]) if conftest and name in conftest.fixtures else None


def why(mod: Module, func: Func, load=load, seen: frozenset = frozenset()) -> str | None:
    """Why `func` enters the entry point (the first path found), or None."""
    if (mod.name, func.name) in seen:
        return None
    seen = seen | {(mod.name, func.name)}
    if func.reasons:
        return func.reasons[0]
    for q in sorted(func.uses):
        hit = resolve(mod, q, load)
        reason = hit and why(*hit, load=load, seen=seen)
        if reason:
            return f"{q} -> {reason}"
    autouse = [f.fixture for f in mod.fixtures.values() if f.autouse and f is not func]
    for name in [*func.params, *autouse]:
        hit = fixture_of(mod, name, load)
        reason = hit and why(*hit, load=load, seen=seen)
        if reason:
            return f"fixture {name} -> {reason}"
    return None


@cache
def integration(name: str) -> dict[str, str | None]:
    """Each test of tests/<name>.py -> why it is integration (None: a unit test)."""
    mod = load(name)
    return {t.name: why(mod, t) for t in mod.tests}


def test_files() -> list[str]:
    return sorted(p.stem for p in TESTS.glob("test_*.py"))
