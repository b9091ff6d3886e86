"""The test pyramid stays honest (issue 37 item 10): every test that trains or runs a command through
the entry point (tests/pyramid.py: the rule, read from the source) is marked integration, and no
other test is, so `make test-fast` (-m "not integration and not slow") is the unit tests, all of
them. A test file whose every test is integration says so once (pytestmark); a test that enters
through a fixture is marked by tests/conftest.py (TRAINING_FIXTURES); any other one is decorated."""
import ast
import re
import textwrap

import pytest

import pyramid
from conftest import TRAINING_FIXTURES, pytest_collection_modifyitems
from pyramid import MARK, integration, load, read_module, why

FILES = pyramid.test_files()


def marked_by(mod, test) -> str | None:
    """How the test is marked integration, read from the source as pytest applies it."""
    if mod.marked:
        return "pytestmark"
    if test.marked:
        return "decorator"
    hit = next((p for p in test.params if p in TRAINING_FIXTURES), None)
    return hit and f"fixture {hit}"


def test_every_test_that_enters_is_marked_and_no_other():
    wrong = []
    for name in FILES:
        mod = load(name)
        for test in mod.tests:
            reason, mark = integration(name)[test.name], marked_by(mod, test)
            where = f"tests/{name}.py:{test.line}: {test.name}"
            if reason and not mark:
                wrong.append(f"{where}: enters the entry point ({reason}) but is not marked {MARK}")
            elif mark and not reason:
                wrong.append(f"{where}: marked {MARK} ({mark}) but enters no entry point (a unit test)")
    assert not wrong, "\n".join(wrong)


def test_a_file_of_integration_tests_says_so_once():
    wrong = []
    for name in FILES:
        mod, found = load(name), integration(name)
        if found and all(found.values()) and not mod.marked:
            wrong.append(f"tests/{name}.py: every test is {MARK}: mark the file (pytestmark = pytest.mark.{MARK})")
        if mod.marked and any(t.marked for t in mod.tests):
            wrong.append(f"tests/{name}.py: pytestmark marks it {MARK}: the decorators repeat it")
        if mod.classes:
            wrong.append(f"tests/{name}.py: test classes {mod.classes}: tests/pyramid.py reads top-level tests only")
    assert not wrong, "\n".join(wrong)


def test_training_fixtures_are_the_fixtures_that_enter():
    """conftest marks a test by the fixture names it requests: the names must be exactly those of the
    fixtures that enter, and no fixture that enters nothing may share one of them."""
    entering, sharing = set(), []
    for name in ["conftest", *FILES]:
        mod = load(name)
        for fixture, func in mod.fixtures.items():
            if why(mod, func):
                entering.add(fixture)
            elif fixture in TRAINING_FIXTURES:
                sharing.append(f"tests/{name}.py:{func.line}: fixture {fixture} enters nothing but shares the "
                               "name of one that trains: rename it")
    assert not sharing, "\n".join(sharing)
    assert entering == TRAINING_FIXTURES, (f"missing from TRAINING_FIXTURES: {sorted(entering - TRAINING_FIXTURES)}; "
                                           f"train nothing: {sorted(TRAINING_FIXTURES - entering)}")


SOURCES = {  # name -> (source, the tests of it that enter)
    "mod_a": ("""
        import subprocess, sys
        import pytest
        from normlab.train import run
        from normlab.commands import study as study_cmd
        from normlab.study.runner import Sweep, plan
        from mod_b import helper_b
        TRAIN = [sys.executable, "train.py"]

        def local_helper(cfg):
            return run(cfg)

        @pytest.fixture(scope="module")
        def trained():
            return local_helper(None)

        @pytest.fixture()
        def on_top(trained):
            return trained

        def test_calls_run():
            run(None)

        def test_through_a_helper():
            local_helper(None)

        def test_through_another_file():
            helper_b()

        def test_through_a_fixture(on_top):
            pass

        def test_a_constant_command_line():
            subprocess.run(TRAIN)

        def test_a_console_script(tmp_path):
            subprocess.run([str(tmp_path / "normlab-train"), "norm=x"])

        def test_python_m():
            subprocess.Popen([sys.executable, "-m", "normlab.commands.study", "--status"])

        def test_study_in_process():
            study_cmd.main(["x", "--status"])

        def test_hands_on_the_entry_point(guard):
            guard(study_cmd.main, [])

        def test_the_runner_runs():
            sweep = Sweep(None, plan(None, None, None), None)
            sweep.run()

        def test_a_training_benchmark_script():
            subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"])

        def test_a_benchmark_script_that_trains_nothing():
            subprocess.run([sys.executable, "benchmarks/peers.py"])

        def test_a_python_c_child_importing_commands():
            subprocess.run([sys.executable, "-c", "import normlab.commands.report_runs"])

        def test_git_and_a_logger_name():
            subprocess.run(["git", "status"]), "normlab-test"

        def test_naming_train_py_without_a_process(tmp_path):
            assert "train.py" in str(tmp_path / "train.py")

        def test_a_runner_not_run():
            Sweep(None, [], None)._progress()

        def test_another_run():
            def run(x):
                return x
            run(1)
    """, {"test_calls_run", "test_through_a_helper", "test_through_another_file", "test_through_a_fixture",
          "test_a_constant_command_line", "test_a_console_script", "test_python_m", "test_study_in_process",
          "test_hands_on_the_entry_point", "test_the_runner_runs", "test_a_training_benchmark_script"}),
    "mod_b": ("""
        from normlab.commands.prune import main as prune_main
        from normlab.commands.train import config_dir

        def helper_b():
            from normlab.commands.train import main
            return main([])

        def test_prune_in_process():
            prune_main([])

        def test_a_train_module_helper_that_trains_nothing():
            config_dir()

        def test_a_local_main_of_another_command():
            from normlab.commands.prune import main
            main([])
    """, set()),
}


def test_the_rule_on_known_cases():
    """Each way in is found (in-process, a helper, another file, a fixture of a fixture, a command line
    built first, a console script, python -m, the study runner) and each near miss is left out."""
    mods = {n: read_module(n, textwrap.dedent(src)) for n, (src, _) in SOURCES.items()}
    for name, (_, expected) in SOURCES.items():
        mod = mods[name]
        found = {t.name for t in mod.tests if why(mod, t, load=mods.get)}
        assert found == expected, (name, sorted(found ^ expected))
    mod = mods["mod_a"]
    assert why(mod, mod.funcs["test_through_a_fixture"], load=mods.get) == \
        "fixture on_top -> fixture trained -> local_helper -> normlab.train.run (line 11)"


def test_a_pytestmark_marks_the_file():
    for value, marked in (("pytest.mark.integration", True), ("[pytest.mark.integration, pytest.mark.skipif(1)]", True),
                          ("pytest.mark.skipif(1)", False)):
        assert read_module("m", f"import pytest\npytestmark = {value}\n").marked is marked, value


class FakeItem:
    def __init__(self, *fixtures, marked=False):
        self.fixturenames, self.marks = list(fixtures), [MARK] if marked else []

    def add_marker(self, mark):
        self.marks.append(mark.name)

    def get_closest_marker(self, name):
        return name if name in self.marks else None


def test_the_hook_marks_a_test_by_the_fixtures_it_requests():
    trains = sorted(TRAINING_FIXTURES)[0]
    items = [FakeItem("tmp_path", trains), FakeItem("tmp_path", "small_corpus"), FakeItem(trains, marked=True)]
    pytest_collection_modifyitems(items)
    assert [i.marks for i in items] == [[MARK], [], [MARK]]  # marked once


def test_the_collected_tests_carry_the_mark(request):
    """Under make test or make test-fast: what pytest collected (after conftest's hook) agrees with
    the rule; a test that enters but is unmarked would run in test-fast and fail here."""
    wrong = []
    for item in request.session.items:
        name = item.path.stem
        if item.path.parent != pyramid.TESTS or name not in FILES:
            continue
        reason, mark = integration(name).get(item.originalname), item.get_closest_marker(MARK)
        if bool(reason) != bool(mark):
            wrong.append(f"{item.nodeid}: enters: {reason}; marked: {mark is not None}")
    assert not wrong, "\n".join(wrong)



BENCHMARKS = pyramid.TESTS.parent / "benchmarks"


def benchmark_enters(name: str, seen: frozenset = frozenset()) -> str | None:
    """Why benchmarks/<name> enters the entry point, or None: it names what trains (pyramid.ENTRY), or
    starts a process and names a command, itself or through a benchmark script it runs, imports or
    hands a process (a module name as a string: a forkserver's preload)."""
    path, files = BENCHMARKS / name, {p.name for p in BENCHMARKS.glob("*.[ps][yh]")}

    def command(text: str) -> bool:  # a listed script counts by what it reaches, not by being listed
        return pyramid.names_command(text) and text.rsplit("/", 1)[-1] not in pyramid.TRAINING_BENCHMARKS

    text = path.read_text(encoding="utf-8")
    reason, named = None, set()
    if path.suffix == ".sh":
        words = re.findall(r"[\w./-]+", text)
        reason = next((w for w in words if command(w)), None)
        named = {w.rsplit("/", 1)[-1] for w in words} & files
    else:
        nodes = list(ast.walk(ast.parse(text)))
        bindings, spawns, commands = pyramid.imports(nodes), False, []
        for n in nodes:
            if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Load) \
                    and pyramid.qualify(n, bindings) in pyramid.ENTRY:
                reason = reason or pyramid.qualify(n, bindings)
            elif isinstance(n, ast.Call) and pyramid.qualify(n.func, bindings) in pyramid.SPAWN:
                spawns = True
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                if command(n.value):
                    commands.append(n.value)
                named |= {n.value.rsplit("/", 1)[-1], f"{n.value}.py"} & files
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                named |= {f"{m}.py" for m in ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module])
                          if m} & files
        reason = reason or (f"starts a process of {commands[0]}" if spawns and commands else None)
    if reason:
        return reason
    for other in sorted(named - seen - {name}):
        found = benchmark_enters(other, seen | {name})
        if found:
            return f"{other} -> {found}"
    return None


def test_each_training_benchmark_enters_the_entry_point():
    """TRAINING_BENCHMARKS cannot go stale: each listed script still reaches what trains."""
    for name in sorted(pyramid.TRAINING_BENCHMARKS):
        assert (BENCHMARKS / name).is_file(), f"benchmarks/{name}: listed in TRAINING_BENCHMARKS but gone"
        assert benchmark_enters(name), f"benchmarks/{name}: listed in TRAINING_BENCHMARKS but trains nothing"
    assert benchmark_enters("gpu_check.sh") == "gpu_check.py -> gpu_parts.py -> gpu_train.py -> normlab.train.run"


def test_each_benchmark_a_test_runs_as_a_process_and_that_enters_is_listed():
    """A benchmark script named in a test file that starts processes, and that reaches what trains, is
    one of TRAINING_BENCHMARKS (so a test that runs it is integration)."""
    files, missing = {p.name for p in BENCHMARKS.glob("*.[ps][yh]")}, []
    for name in FILES:
        nodes = list(ast.walk(ast.parse((pyramid.TESTS / f"{name}.py").read_text(encoding="utf-8"))))
        bindings = pyramid.imports(nodes)
        if not any(isinstance(n, ast.Call) and pyramid.qualify(n.func, bindings) in pyramid.SPAWN for n in nodes):
            continue
        named = {n.value.rsplit("/", 1)[-1] for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        for script in sorted(named & files - pyramid.TRAINING_BENCHMARKS):
            reason = benchmark_enters(script)
            if reason:
                missing.append(f"tests/{name}.py runs benchmarks/{script}, which enters ({reason}): add it to "
                               "tests/pyramid.py's TRAINING_BENCHMARKS")
    assert not missing, "\n".join(missing)
