"""Hydra's compose for the test processes, each composition done once (issue 37 item 10: `make
test-fast` under 2 minutes). Composing costs ~0.3 s of CPU a config, most of it reading and merging
the defaults list's files, and the study, identity and sweep tests compose ~700 configs that differ
mostly in values (a seed, a label, a corpus path) over ~80 choices of config groups.

Hydra composes in two steps (hydra/_internal/config_loader_impl.py, `_load_configuration_impl`):
the group overrides (`norm=postnorm`, `+arm=deepnorm`) choose the defaults list, the files are
merged into one config, and then every other override is applied to it in the order given
(`ConfigLoaderImpl._apply_overrides_to_config`, an OmegaConf update per key). This module keeps the
first step's result per (config sources, config name, group overrides) and does the second step with
Hydra's own function on a copy, which is what Hydra's compose returns (tests/test_compose_cache.py
compares the two on every kind of override). Anything else (a sweep, a `hydra.` key, the Hydra node
asked for, a primary config that adds search paths) is composed by Hydra whole; a failure of either
step is composed again by Hydra whole, so an error is Hydra's own, raised every time, never kept.
The same conf/ files give the same config: nothing in conf/ reads the environment while composing,
and no test writes to conf/.

Each composition still reads its files; a YAML text already parsed in this process is not parsed
again (`load`: ~17% of a composition's CPU), whatever reads it (Hydra, a run's saved config); and a
config file Hydra's repository loaded before (`load_config`: the file's config, its header and its
defaults list, built once per process for the same bytes) is a copy of that (~25% of a composition's
CPU: most configs differ in one arm or preset over the same ~120 files).

The worker processes of one `pytest -n` run share the first step too (`shared`, a folder of the run
that conftest sets under xdist): the study tests of several files compose the same arms, and a file
runs on whichever worker is free, so each worker would otherwise compose them again."""
import copy
import functools
import hashlib
import os
import pickle
import sys
from pathlib import Path

from hydra._internal.config_repository import ConfigRepository
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

hydra_compose = sys.modules["hydra.compose"].compose  # Hydra's own, before install()
omegaconf_load = OmegaConf.load  # OmegaConf's own, before install()
repository_load = ConfigRepository.load_config  # Hydra's own, before install()
# Kept pickled: a copy is unpickled (OmegaConf's pickling keeps every node, flag and type, as
# Hydra's launchers rely on), 7x faster than copy.deepcopy of a config.
composed: dict = {}  # (sources, config name, overrides, return_hydra_config) -> a config Hydra composed whole
bases: dict = {}  # (sources, config name, group overrides) -> the config before the other overrides
_parser = OverridesParser.create()
_yaml: dict = {}  # YAML text -> what OmegaConf's YAML loader made of it (plain lists, dicts, scalars)
shared: Path | None = None  # a folder of this test run's processes: each base there once, pickled
files: dict = {}  # (sources, config path, the file's bytes or stored node) -> (it, what Hydra loaded, pickled)
keep_files = True  # False: Hydra's repository loads every file itself (test_compose_cache's reference)


def _shared_file(key) -> Path | None:
    """The file of a base in `shared` (its key: strings and tuples of them, the same in every process)."""
    return shared / f"{hashlib.sha256(repr(key).encode()).hexdigest()}.pickle" if shared is not None else None


def install():
    """For the test process: Hydra's compose (`from hydra import compose`, which normlab imports when
    composing) and OmegaConf.load become this module's; before the test modules import them."""
    sys.modules["hydra.compose"].compose = sys.modules["hydra"].compose = compose
    OmegaConf.load = staticmethod(load)
    ConfigRepository.load_config = load_config
    return compose


def load_config(repo, config_path: str):
    """Hydra's ConfigRepository.load_config, a config loaded once per process for the same bytes (a
    file of a folder or of a package: Hydra's own configs) or the same node of the ConfigStore (which
    a program may change: normlab.launchers stores nodes), a copy for every caller: Hydra re-parents
    and merges what it loads. A failure is Hydra's own, never kept."""
    source = repo._find_object_source(config_path=config_path, object_type=ObjectType.CONFIG) if keep_files else None
    scheme = source.scheme() if source is not None else None  # (by scheme: Hydra's plugin scan reloads the classes)
    if scheme == "file":
        path = os.path.realpath(os.path.join(source.path, source._normalize_file_name(config_path)))
        with open(path, "rb") as f:
            content = f.read()
    elif scheme == "pkg":
        content = None  # an installed package's file
    elif scheme == "structured":  # the ConfigStore's node: storing the name again stores another node
        content = source.store._load(source._normalize_file_name(config_path))
    else:
        return repository_load(repo, config_path)
    key = (tuple((s.provider, s.path) for s in repo.get_sources()), config_path,
           content if not hasattr(content, "node") else id(content))
    if key not in files:
        result = repository_load(repo, config_path)
        files[key] = (content, pickle.dumps(result))  # (a stored node kept: its id is not reused meanwhile)
        return result
    return pickle.loads(files[key][1])


def load(file_):
    """OmegaConf.load, each YAML text parsed once per process: OmegaConf builds the config from a copy
    of what its loader (`get_yaml_loader`) made of the text. A text that does not parse, or anything
    but an open file, is OmegaConf's own (its errors name the file)."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    if not hasattr(file_, "read") or not hasattr(file_, "seek"):
        return omegaconf_load(file_)
    start = file_.tell()
    text = file_.read()
    if text not in _yaml:
        try:
            obj = yaml.load(text, Loader=get_yaml_loader())
        except Exception:
            obj = load  # not a YAML text
        if not (obj is None or isinstance(obj, (list, dict))):  # an error or a str: OmegaConf's own
            file_.seek(start)
            return omegaconf_load(file_)
        _yaml[text] = obj
    obj = _yaml[text]
    return OmegaConf.create() if obj is None else OmegaConf.create(copy.deepcopy(obj))


def compose(config_name=None, overrides=None, return_hydra_config=False, **kw):
    """Hydra's compose, each config once per test process, a copy for every caller."""
    overrides = list(overrides or ())
    if kw or not GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name=config_name, overrides=overrides,
                             return_hydra_config=return_hydra_config, **kw)
    loader = GlobalHydra.instance().config_loader()
    sources = tuple((s.provider, s.path) for s in loader.get_sources())
    key = (sources, config_name, tuple(overrides), return_hydra_config)
    if key not in composed:
        cfg = None if return_hydra_config else _from_base(loader, sources, config_name, overrides)
        if cfg is not None:
            return cfg  # a copy already, and deriving it again costs little more than copying it
        composed[key] = pickle.dumps(hydra_compose(config_name=config_name, overrides=overrides,
                                                   return_hydra_config=return_hydra_config))
    return pickle.loads(composed[key])


@functools.lru_cache(maxsize=None)
def _parsed(override: str):
    """Hydra's parse of one override (what `OverridesParser.parse_overrides` does for each), kept: the
    same few hundred lines recur in every study's runs, and applying an override leaves it as it was."""
    return _parser.parse_override(override)


def split(loader, overrides: list[str]):
    """(group overrides as given, the parsed others in order) as Hydra's defaults list tells them
    apart (hydra/_internal/defaults_list.py, `Overrides`: a dict value or a key that is no config
    group is a config override); None when Hydra should compose them whole."""
    try:
        parsed = [_parsed(o) for o in overrides]
    except Exception:
        return None  # Hydra's own error
    groups, values = [], []
    for o in parsed:
        if o.is_sweep_override() or o.key_or_group.startswith("hydra"):
            return None
        if loader.repository.group_exists(o.key_or_group) and not isinstance(o.value(), dict):
            groups.append(o.input_line)
        else:
            values.append(o)
    return groups, values


def _from_base(loader, sources, config_name, overrides: list[str]):
    """Hydra's two steps, the first one cached; None: compose whole (see the module's docstring)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    parts = split(loader, overrides)
    if parts is None:
        return None
    groups, values = parts
    key = (sources, config_name, tuple(groups))
    path = _shared_file(key)
    if key not in bases and path is not None and path.is_file():  # composed by another process of the run
        bases[key] = path.read_bytes()
    if key not in bases:
        try:
            base = hydra_compose(config_name=config_name, overrides=groups, return_hydra_config=True)
        except Exception:
            return None
        # search paths added by the primary config may hold groups the loader does not list
        searchpath = base.hydra.get("searchpath")
        with open_dict(base):  # as Hydra's compose does when its node is not asked for (no value
            del base["hydra"]  # override reaches it: a `hydra.` key is composed whole)
        bases[key] = None if searchpath else pickle.dumps(base)
        if path is not None and bases[key] is not None:  # whole or not at all: written aside, then renamed
            part = path.with_name(f"{path.stem}.{os.getpid()}.part")
            part.write_bytes(bases[key])
            os.replace(part, path)
    if bases[key] is None:
        return None
    cfg = pickle.loads(bases[key])
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except Exception:
        return None
    return cfg
