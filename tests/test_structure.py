"""The package's structure: arrows run one way (design.md), choice lists have one owner."""
import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "normlab").rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for every test here (they only read it)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = _tree(path)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module level", "any level"])
def test_imports_have_no_cycle(top_level_only):
    """No import cycle, also counting imports inside functions (which only hide one)."""
    mods = _modules()
    graph = {m: {i for i in _imports(p, top_level_only) if i in mods and i != m} for m, p in mods.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_model_package_imports_nothing_upstream():
    # The model is built from its dataclass alone: it may use norms, attention, regularizers, but
    # not init/ (Admin works on a built model), callbacks, commands, training, Lightning or Hydra.
    upstream = ("normlab.init", "normlab.callbacks", "normlab.commands", "normlab.train", "normlab.lit_module",
                "lightning", "pytorch_lightning", "hydra", "omegaconf")
    for path in (SRC / "normlab" / "model").glob("*.py"):
        bad = sorted(i for i in _imports(path, top_level_only=False) if i.startswith(upstream))
        assert not bad, f"{path.name} imports {bad}"


def test_choice_lists_are_the_owners():
    from normlab import config, losses, lr_schedule, settings
    from normlab.config import ConfigError, NormConfig
    from normlab.model import initialization, norms, qk_norms, schemes
    from normlab.regularizers import layerdrop

    assert config.PLACEMENTS is schemes.PLACEMENTS == tuple(schemes.SCHEMES)  # the registry owns them
    assert config.INITS is initialization.INITS
    assert config.QK_NORMS is qk_norms.QK_NORMS
    assert config.LAYERDROP_RATES is layerdrop.RATES and settings.LR_SCHEDULES is lr_schedule.SCHEDULES
    assert settings.LABEL_SMOOTHING_CONVENTIONS is losses.CONVENTIONS
    with pytest.raises(ConfigError, match=r"\(allowed: " + ", ".join(norms.NORMS) + r"\)"):
        NormConfig(type="batchnorm").validate()


def test_one_error_family():
    """Every exception normlab defines for bad input is a UserError (one line, exit 2, one format);
    the only others are control flow (a preempted run stops after its checkpoint; SIGTERM / SIGUSR1
    stop the final passes)."""
    import importlib
    import inspect

    from normlab.errors import UserError, user_error_types

    control_flow = {"StopAfterCheckpoint", "Signalled"}
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name:
                found[cls_name] = cls
    assert {"CorpusError", "ConfigError", "CheckpointError", "CommandError", "CheckpointMismatch", "UsageError"} <= set(found)
    outside = sorted(n for n, c in found.items() if not issubclass(c, UserError) and n not in control_flow)
    assert not outside, outside
    assert user_error_types() == (UserError,)


def test_identity_reads_nothing():
    """identity.py is pure functions of the resolved values (issue 18): no file, folder or checkpoint
    is read there; a start checkpoint's model is merged in by run_identity.identify."""
    tree = _tree(SRC / "normlab" / "identity.py")
    io = {"open", "read_text", "read_bytes", "load", "is_file", "is_dir", "exists", "glob", "stat", "iterdir"}
    calls = sorted({n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id for n in ast.walk(tree)
                    if isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))})
    assert not io & set(calls), io & set(calls)
    # nor does it load the model: of normlab it imports only the schemes' torch-free label rule,
    # which imports nothing and names registered schemes (issue 20)
    labels = "normlab.model.scheme_labels"
    assert not {i for i in _imports(SRC / "normlab" / "identity.py", top_level_only=False)
                if i.startswith(("normlab", "torch")) and not i.startswith(labels)}
    assert not _imports(_modules()[labels], top_level_only=False)
    from normlab.model import scheme_labels, schemes

    assert set(scheme_labels.NAMED_WITH_NORM) <= set(schemes.SCHEMES)


def test_only_the_schemes_compare_placements():
    """A residual scheme is one object (issue 20): no code outside the model/schemes/ package tests
    a placement by its name (==, !=, in, not in); it asks the scheme (schemes.get_scheme)."""
    from normlab.model.schemes import SCHEMES

    found = []
    for name, path in sorted(_modules().items()):
        if name == "normlab.model.schemes" or name.startswith("normlab.model.schemes."):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Compare):
                consts = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
                found += [f"{name}:{node.lineno} {p!r}" for p in sorted(consts & set(SCHEMES))]
    assert not found, found


# The raw Hydra config is read where a run is resolved (issue 18): the commands, the study runner
# (it composes its arms to name them), the resolution itself (run_spec, identity, run_identity, resolvers,
# config's validation (run_config), failure's naming of a run that did not resolve); the
# Hydra wiring of objects (callbacks, loggers) instantiates nodes it is handed and reads no value.
RESOLUTION = ("normlab.commands", "normlab.study", "normlab.run_spec", "normlab.identity", "normlab.run_identity",
              "normlab.resolvers", "normlab.config", "normlab.run_config", "normlab.run_folder", "normlab.failure")
WIRING = ("normlab.callbacks", "normlab.loggers")


def test_no_raw_config_below_the_resolution():
    for name, path in sorted(_modules().items()):
        if name.startswith(RESOLUTION) or name in WIRING:
            continue
        bad = sorted(i for i in _imports(path, top_level_only=False) if i.startswith("omegaconf"))
        assert not bad, f"{name} imports {bad}: take the resolved values (run_spec.RunSpec), not the config"


# Hydra's runtime state (HydraConfig: a job's choices, typed overrides, sweep folder, mode and folder;
# GlobalHydra) is read in one place (issue 37 item 1): run_identity.hydra_runtime, through private_api's
# adapter; every other module is given a run_identity.Runtime.
HYDRA_STATE = ("HydraConfig", "hydra_job_config", "GlobalHydra", "hydra_config", "global_hydra")


def _hydra_state_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every name, attribute or import naming Hydra's global state."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in n.names] + ([n.module] if isinstance(n, ast.ImportFrom) and n.module else [])
            out += [(n.lineno, x) for x in names if any(part in HYDRA_STATE for part in x.split("."))]
        elif isinstance(n, ast.Name) and n.id in HYDRA_STATE or isinstance(n, ast.Attribute) and n.attr in HYDRA_STATE:
            out.append((n.lineno, n.id if isinstance(n, ast.Name) else n.attr))
    return out


def test_only_the_identity_module_reads_hydras_runtime_state():
    found = [f"{name}:{line}: {what}" for name, path in sorted(_modules().items())
             if name not in ("normlab.private_api", "normlab.run_identity")
             for line, what in _hydra_state_uses(_tree(path))]
    assert not found, found
    # and there, one function: the one the training command's job calls
    tree = _tree(SRC / "normlab" / "run_identity.py")
    readers = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and _hydra_state_uses(f)}
    assert readers == {"hydra_runtime"}, readers


def test_a_run_reads_its_spec_alone():
    """train._run (everything after resolve) names no `cfg`: it takes the RunSpec's values."""
    tree = _tree(SRC / "normlab" / "train.py")
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_run")
    names = {n.id for n in ast.walk(run) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(run) if isinstance(n, ast.Attribute)}
    assert "cfg" not in names and "spec" in names


def test_no_module_imports_another_modules_private_names():
    """A helper shared across modules is public (normlab.config's check, check_number, ... used by
    run_config): `from normlab.x import _name` means a private helper leaked. `import ... as _alias`
    of a public name is fine."""
    bad = []
    for name, path in _modules().items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("normlab"):
                bad += [f"{name}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_every_scheme_is_in_the_study_tools():
    """Issue 20, item 3: every registered scheme, and every arm in conf/arm/, is an arm of the
    output-change study and of a deep-stack sweep (+sweep=deep_stack or deep_stack_recent, and each
    one's _paper preset); a new scheme or arm that is left out of them fails here. The arms name a scheme through conf/arm/*.yaml's
    norm group (conf/norm/*.yaml's placement) or, in output_change, model.norm.placement."""
    import yaml

    from normlab.model.schemes import SCHEMES

    conf = SRC.parent / "conf"
    study = yaml.safe_load((conf / "study" / "output_change.yaml").read_text())
    probed = {a["model"]["norm"]["placement"] for a in study["arms"].values()}
    assert probed == set(SCHEMES), set(SCHEMES) ^ probed

    def placement(arm):  # an arm's norm group file, and the placement it sets (post if it sets none)
        defaults = yaml.safe_load((conf / "arm" / f"{arm}.yaml").read_text())["defaults"]
        norm = next(d["override /norm"] for d in defaults if isinstance(d, dict) and "override /norm" in d)
        node = yaml.safe_load((conf / "norm" / f"{norm}.yaml").read_text())
        return node.get("placement", "post")

    arm_files = {p.stem for p in (conf / "arm").glob("*.yaml")}
    # the stability axis's arms (issue 38: z-loss, gates, sinks, caps, optimizers) are arms of the stability
    # study and its paper sweep, not of the depth sweeps or the output-change probe (most are the pre-LN
    # model at init): an arm in neither fails below
    stability = set(yaml.safe_load((conf / "sweep" / "stability_paper.yaml").read_text())
                    ["hydra"]["sweeper"]["params"]["+arm"].split(","))
    for paper in ("", "_paper"):
        swept = set()
        for sweep in ("deep_stack", "deep_stack_recent"):
            node = yaml.safe_load((conf / "sweep" / f"{sweep}{paper}.yaml").read_text())
            swept |= set(node["hydra"]["sweeper"]["params"]["+arm"].split(","))
        assert {placement(a) for a in swept} == set(SCHEMES), (paper, set(SCHEMES) ^ {placement(a) for a in swept})
        # and every arm (hyper-connections, DLCL, DenseFormer, QK-norm, ... are arms, not placements)
        assert swept <= arm_files and arm_files - swept <= stability, (paper, arm_files - swept - stability)
    stability_only = arm_files - swept
    # output_change: one probe arm per arm file (its names say which: pre_scalenorm_fixnorm is pre_sn_fix)
    assert set(study["arms"]) ^ (arm_files - stability_only) == {"pre_sn_fix", "pre_scalenorm_fixnorm"}


def _own_private_names() -> set[str]:
    """Private names normlab defines itself (functions, classes, attributes it assigns, module
    variables, config keys like `_target_`): reaching those is not another library's private API."""
    names = {"_target_", "_convert_", "_recursive_", "_partial_"}
    for path in _modules().values():
        for n in ast.walk(_tree(path)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
    return {x for x in names if x.startswith("_")}


def _private_reach_ins(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each private name of another library a module reaches: an attribute
    (`trainer._signal_connector`), one inherited from a library's class (`self._modules` in a
    torch Module subclass: a private name normlab never assigns or defines), or one named by a
    string (`getattr(array, "_mmap")`, hasattr / setattr / delattr alike)."""
    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__") and name not in own

    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and private(n.attr):
            found.append((n.lineno, f".{n.attr}"))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                and n.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(n.args) >= 2 \
                and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str) and private(n.args[1].value):
            found.append((n.lineno, f"{n.func.id}(..., {n.args[1].value!r})"))
    return found


def test_private_reach_ins_live_in_private_api():
    """Issue 37 item 4: another library's private attribute (Lightning's `_trainer`, torch's
    `Tensor._version` and `Module._forward_hooks`, numpy's `memmap._mmap`, OmegaConf's `_get_node`,
    ...), read directly, through `self` in a subclass or by name in a getattr, is used only in
    private_api.py, whose canary tests (tests/test_private_api.py) fail by name when an upgrade
    changes one; nor does a module read the process's `sys.argv` (the entry points pass what they
    know), and none but private_api touches Hydra's global singleton."""
    own = _own_private_names()
    found = []
    for name, path in _modules().items():
        if name == "normlab.private_api":
            continue
        tree = _tree(path)
        entry = {id(x) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in ("main", "cli")
                 for x in ast.walk(f)}  # an entry point reads its own command line
        found += [f"{name}:{line}: {what}" for line, what in _private_reach_ins(tree, own)]
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr == "instance" and isinstance(n.value, ast.Name) \
                    and n.value.id in ("HydraConfig", "GlobalHydra"):
                found.append(f"{name}:{n.lineno}: {n.value.id}.instance()")
            if isinstance(n, ast.Attribute) and n.attr == "argv" and isinstance(n.value, ast.Name) \
                    and n.value.id == "sys" and id(n) not in entry:
                found.append(f"{name}:{n.lineno}: sys.argv")
        found += [f"{name}: imports {i}" for i in _imports(path, top_level_only=False) if "global_hydra" in i]
    assert not found, found


@pytest.mark.parametrize("code, reached", [
    ("mm = getattr(arrays[kind], '_mmap', None)", ["getattr(..., '_mmap')"]),
    ("hasattr(module, '_forward_hooks')", ["hasattr(..., '_forward_hooks')"]),
    ("class B(nn.Module):\n    def f(self):\n        return self._forward_hooks", ["._forward_hooks"]),
    ("trainer._signal_connector", ["._signal_connector"]),
    ("class C:\n    def f(self):\n        self._lr = 1\n        return self._lr, getattr(self, '_lr')", []),  # its own
])
def test_the_reach_in_finder_sees_each_form(code, reached):
    """The structure test's finder on each form a reach-in takes, and on a class's own private state."""
    assert [what for _, what in _private_reach_ins(ast.parse(code), {"_lr"})] == reached
