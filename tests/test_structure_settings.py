"""Settings are typed and passed at construction (issue 37 item 2), checked on the source:

- no callback looks the LightningModule's attributes up by name (getattr / hasattr with a string):
  it reads what the module declares (Seq2SeqModule.stats, decode_valid, hold_stall, model_cfg) or is
  given the value when it is built (callbacks.RunValues);
- train.py sets no attribute on a callback after building it: the run's values go in its constructor;
- the optimizer's and evaluation's defaults live in settings.py alone: no `.get("warmup", 4000)`
  elsewhere repeats one.
Each rule's detector is also run on a snippet that breaks it, so the rule can fail.
"""
import ast
import dataclasses
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "normlab"


def _module_names(func: ast.AST) -> set[str]:
    """The names a function binds to the LightningModule: Lightning's hook parameter `pl_module`, and
    names assigned from it or from `<trainer>.lightning_module`."""
    names = {a.arg for a in ast.walk(func.args) if isinstance(a, ast.arg) and a.arg == "pl_module"}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and _is_module(node.value, names):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_module(expr: ast.AST, names: set[str]) -> bool:
    return ((isinstance(expr, ast.Name) and expr.id in names)
            or (isinstance(expr, ast.Attribute) and expr.attr == "lightning_module"))


def reads_by_name(source: str) -> list[str]:
    """`line: getattr(<module>, "<attr>")` for each getattr / hasattr of the LightningModule with a string."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = _module_names(func)
        for call in ast.walk(func):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in ("getattr", "hasattr")
                    and len(call.args) >= 2 and _is_module(call.args[0], names)
                    and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str)):
                found.append(f"{call.lineno}: {call.func.id}(..., {call.args[1].value!r})")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def callback_pokes(source: str) -> list[str]:
    """`line: <name>.<attr> =` for each attribute set on an object that came from the built callbacks
    (a name assigned from an expression that reads `callbacks` or calls build_callbacks /
    instantiate_callbacks, or a loop variable over one)."""
    builders = {"build_callbacks", "instantiate_callbacks"}
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        tainted = {"callbacks"}

        def reads(expr) -> bool:
            return any((isinstance(n, ast.Name) and n.id in tainted)
                       or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in builders)
                       for n in ast.walk(expr))

        for _ in range(3):  # a name tainted through another: a few passes reach the fixed point
            for node in ast.walk(func):
                if isinstance(node, ast.Assign) and reads(node.value):
                    tainted |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                elif isinstance(node, (ast.For, ast.comprehension)) and reads(node.iter):
                    tainted |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        for node in ast.walk(func):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id in tainted:
                        found.append(f"{node.lineno}: {el.value.id}.{el.attr} =")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_no_callback_reads_the_lightning_module_by_name():
    bad = [f"callbacks/{p.name}:{hit}" for p in sorted((SRC / "callbacks").glob("*.py"))
           for hit in reads_by_name(p.read_text(encoding="utf-8"))]
    assert not bad, bad


def test_train_sets_nothing_on_a_callback_after_building_it():
    bad = callback_pokes((SRC / "train.py").read_text(encoding="utf-8"))
    assert not bad, bad


@pytest.mark.parametrize("snippet, hits", [
    ("def on_train_end(self, trainer, pl_module):\n    x = getattr(pl_module, 'optim_cfg', {})\n", 1),
    ("def hook(self, trainer, pl_module):\n    return hasattr(pl_module, 'hold_stall')\n", 1),
    ("def f(self, trainer):\n    m = trainer.lightning_module\n    return getattr(m, 'decode_valid', True)\n", 1),
    ("def f(self, trainer):\n    return getattr(trainer.lightning_module, 'decode_valid', True)\n", 1),
    # not the module: a model's submodule, the trainer's plugin, the callback itself
    ("def f(self, trainer, pl_module):\n    a = getattr(block.sublayer, 'qk_norm', None)\n"
     "    b = getattr(trainer.precision_plugin, 'scaler', None)\n    return getattr(self, '_lr', 0)\n", 0),
])
def test_the_module_read_detector_finds_what_it_must(snippet, hits):
    assert len(reads_by_name(snippet)) == hits


@pytest.mark.parametrize("snippet, hits", [
    ("def _run(spec):\n    callbacks = build_callbacks(spec)\n    full = next((c for c in callbacks), None)\n"
     "    full.started, full.code = 1, 2\n", 2),
    ("def _run(spec):\n    cbs = build_callbacks(spec)\n    for c in cbs:\n        c.max_time = 3\n", 1),
    ("def _run(spec):\n    callbacks = build_callbacks(spec)\n    stall = pick(callbacks)\n    s2 = stall\n"
     "    s2.carry_end = False\n", 1),
    ("def _run(spec):\n    callbacks = build_callbacks(spec)\n    results = {}\n    results.x = 1\n", 0),
])
def test_the_callback_poke_detector_finds_what_it_must(snippet, hits):
    assert len(callback_pokes(snippet)) == hits


def _repeated_defaults(source: str, keys: set[str]) -> list[str]:
    """`line: .get('<key>', <default>)` for a key of the settings' dataclasses read with a default."""
    return [f"{n.lineno}: .get({n.args[0].value!r}, ...)" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
            and len(n.args) == 2 and isinstance(n.args[0], ast.Constant) and n.args[0].value in keys]


def test_the_optim_and_eval_defaults_are_written_once():
    """Each default is a field default of settings.OptimSpec / EvalSpec (a decoder's: make_decoder's);
    nowhere else reads one of those keys with a default of its own."""
    from normlab.settings import DECODER_KEYS, EvalSpec, OptimSpec

    keys = {f.name for cls in (OptimSpec, EvalSpec) for f in dataclasses.fields(cls)} | set(DECODER_KEYS)
    bad = [f"{p.relative_to(SRC)}:{hit}" for p in sorted(SRC.rglob("*.py")) if p.name != "settings.py"
           for hit in _repeated_defaults(p.read_text(encoding="utf-8"), keys)]
    assert not bad, bad
    assert len(_repeated_defaults('o.get("warmup", 0); o.get("warmup"); d.get("lenpen", 0.6)', keys)) == 2
