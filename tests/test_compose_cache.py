"""tests/compose_cache.py, what keeps the study, identity and sweep tests inside make test-fast's time,
returns what Hydra's compose returns: for every kind of override, and for the runs a shipped study
plans, the same config (values, interpolations unresolved and resolved, struct flag) or the same
error, each time, and a copy that a caller may change; and its OmegaConf.load what OmegaConf's does."""
import pytest
import yaml
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

import compose_cache
from conftest import CONF, ROOT, initialize_config_dir

# Each kind Hydra tells apart (hydra/_internal/defaults_list.py, `Overrides`; config_loader_impl.py,
# `_apply_overrides_to_config`), the group and value overrides interleaved, the same key twice.
KINDS = [
    ["model.d_model=64", "norm=postnorm", "optim.lr=2e-3", "seed=3", "seed=4"],  # values around a group
    ["+arm=deepnorm", "experiment=deep_stack", "model.d_model=64"],  # an added group, a preset (_global_)
    ["regularizer=layerdrop", "regularizer.encoder_layerdrop=0.3"],  # a value inside the chosen group
    ["~callbacks.plateau", "++newkey=3", "+labels.extra='none'", "tags=[a,b]"],  # delete, force-add, add, list
    ["model.d_model=40", "model={d_model: 48, encoder_layers: 2}"],  # a dict value merges, in order
    ["model={d_model: 48}", "model.d_model=40"],
    ["model.encoder_layers=${model.decoder_layers}", "run_dir=${data.cache_dir}/x", "name=null", "seed="],
    ["logger=[csv,tensorboard]", "debug=limit"],  # a list of group options, a debug preset
    ["hydra.run.dir=/tmp/x", "seed=2"],  # a hydra key: composed whole
]
ERRORS = [  # raised by either step: each time, Hydra's own
    (["nokey=1"], ConfigCompositionException, "Could not override 'nokey'"),
    (["seed=9", "+seed=3"], ConfigCompositionException, "An item is already at 'seed'"),
    (["norm=sideways", "seed=2"], MissingConfigException, "norm/sideways"),
    (["seed=1,2"], ConfigCompositionException, "Ambiguous value for argument 'seed=1,2'"),
]


def nodes(cfg, path="") -> list:
    """Every node's path, class and flags (struct, readonly, ...): what a copy must keep."""
    out = [(path, type(cfg).__name__, cfg._metadata.flags)]
    for k in (cfg.keys() if OmegaConf.is_dict(cfg) else range(len(cfg)) if OmegaConf.is_list(cfg) else ()):
        out += nodes(cfg._get_node(k), f"{path}.{k}")
    return out


def same(a, b) -> bool:
    return (OmegaConf.to_yaml(a) == OmegaConf.to_yaml(b) and nodes(a) == nodes(b)
            and OmegaConf.to_container(a, resolve=True) == OmegaConf.to_container(b, resolve=True))


@pytest.mark.parametrize("overrides", KINDS, ids=lambda o: " ".join(o)[:40])
def test_every_kind_of_override_composes_as_hydra_does(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cached, again = compose_cache.compose("config", overrides), compose_cache.compose("config", overrides)
        hydras = compose_cache.hydra_compose(config_name="config", overrides=overrides)
    assert same(cached, hydras) and same(again, hydras)


@pytest.mark.parametrize("overrides, error, says", ERRORS, ids=lambda o: str(o)[:30])
def test_a_bad_override_fails_as_in_hydra_each_time(overrides, error, says):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for compose in (compose_cache.compose, compose_cache.compose, compose_cache.hydra_compose):
            with pytest.raises(error, match=says):
                compose(config_name="config", overrides=overrides)


def test_group_choices_compose_once_and_each_caller_gets_a_copy(monkeypatch):
    """Hydra composes the group choices once (values aside), a repeat composes nothing, and a caller's
    change stays in its copy."""
    hydra_compose, calls = compose_cache.hydra_compose, []

    def counted(**kw):
        calls.append(kw["overrides"])
        return hydra_compose(**kw)

    monkeypatch.setattr(compose_cache, "hydra_compose", counted)
    monkeypatch.setattr(compose_cache, "bases", {})
    monkeypatch.setattr(compose_cache, "composed", {})
    monkeypatch.setattr(compose_cache, "shared", None)  # this process alone (no base from another worker)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        first = compose_cache.compose("config", ["norm=postnorm", "seed=7"])
        other = compose_cache.compose("config", ["seed=8", "norm=postnorm", "model.d_model=48"])
        again = compose_cache.compose("config", ["norm=postnorm", "seed=7"])
        assert calls == [["norm=postnorm"]]
        first.seed = 9
        assert again.seed == 7 and other.seed == 8 and other.model.d_model == 48 and first is not again
        assert compose_cache.compose("config", ["norm=postnorm", "seed=7"]).seed == 7
        assert same(other, hydra_compose(config_name="config", overrides=["seed=8", "norm=postnorm",
                                                                          "model.d_model=48"]))
        # a failure is never kept: each time its group choices fail, then Hydra composes it whole and
        # raises its own error (as test_pyramid.py checked conftest's compose_once, which this replaced)
        kept = (dict(compose_cache.bases), dict(compose_cache.composed))
        for _ in range(2):
            with pytest.raises(MissingConfigException):
                compose_cache.compose("config", ["norm=sideways", "seed=7"])
        assert calls == [["norm=postnorm"], *[["norm=sideways"], ["norm=sideways", "seed=7"]] * 2]
        assert (compose_cache.bases, compose_cache.composed) == kept


def test_a_base_another_process_of_the_run_composed_is_read_not_composed(tmp_path, monkeypatch):
    """Under pytest -n the workers share the bases (compose_cache.shared): a process with none in memory
    reads the one another composed, and gets what Hydra composes; a failure is never shared."""
    hydra_compose, calls = compose_cache.hydra_compose, []

    def counted(**kw):
        calls.append(kw["overrides"])
        return hydra_compose(**kw)

    monkeypatch.setattr(compose_cache, "hydra_compose", counted)
    monkeypatch.setattr(compose_cache, "shared", tmp_path)
    monkeypatch.setattr(compose_cache, "composed", {})
    overrides = ["norm=postnorm", "seed=8", "model.d_model=48"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for _ in range(2):  # the first process composes it, the second (nothing in memory) reads it
            monkeypatch.setattr(compose_cache, "bases", {})
            cfg = compose_cache.compose("config", overrides)
            assert calls == [["norm=postnorm"]] and len(list(tmp_path.iterdir())) == 1
            assert same(cfg, hydra_compose(config_name="config", overrides=overrides))
        with pytest.raises(MissingConfigException):
            compose_cache.compose("config", ["norm=sideways", "seed=7"])
    assert [p.suffix for p in tmp_path.iterdir()] == [".pickle"]


def test_a_config_file_loaded_before_is_a_copy_and_a_changed_one_is_loaded_anew(tmp_path, monkeypatch):
    """compose_cache.load_config: configs compose as when Hydra's repository loads every file itself;
    a file whose bytes changed, and a ConfigStore node stored again, are loaded anew."""
    from hydra.core.config_store import ConfigStore

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for overrides in (KINDS[1], KINDS[3], KINDS[7]):
            kept = compose_cache.hydra_compose(config_name="config", overrides=overrides)
            monkeypatch.setattr(compose_cache, "keep_files", False)
            own = compose_cache.hydra_compose(config_name="config", overrides=overrides)
            monkeypatch.setattr(compose_cache, "keep_files", True)
            assert same(kept, own) and same(compose_cache.hydra_compose(config_name="config", overrides=overrides), own)
    (tmp_path / "config.yaml").write_text("a: 1\n")
    store = ConfigStore.instance()
    store.store(name="compose_cache_probe", node={"b": 1})
    try:
        with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
            for value in (1, 2):
                (tmp_path / "config.yaml").write_text(f"a: {value}\n")
                store.store(name="compose_cache_probe", node={"b": value})
                assert compose_cache.hydra_compose(config_name="config").a == value
                assert compose_cache.hydra_compose(config_name="compose_cache_probe").b == value
    finally:
        store.repo.pop("compose_cache_probe.yaml", None)


def test_a_studys_runs_compose_as_in_hydra():
    """The configs a shipped study plans (its arms' groups and values, its labels, the smoke budget's
    overrides) are Hydra's own, so the plans the study tests check are those of the study command."""
    from normlab.study.plan import study_labels
    from normlab.study.spec import load_study

    study = load_study("deep_recent", "smoke")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for arm in ("post_ln", "qk_norm"):
            overrides = [*study.arm_overrides(study.arms[arm], 1), *study_labels(study, study.arms[arm])]
            assert same(compose_cache.compose("config", overrides),
                        compose_cache.hydra_compose(config_name="config", overrides=overrides))


def test_a_yaml_text_loads_as_omegaconf_loads_it(tmp_path):
    """Config files (two of each group of conf/, sweeps/, a study) twice, the second time parsed no
    more; a changed file is read anew; a text that is no config and one that does not parse are
    OmegaConf's own."""
    folders = sorted({p.parent for p in ROOT.glob("conf/**/*.yaml")})
    files = [ROOT / "conf" / "config.yaml"] + [p for d in folders for p in sorted(d.glob("*.yaml"))[:2]]
    assert len(files) > 20
    for path in files:
        own = compose_cache.omegaconf_load(path)
        for _ in range(2):
            with open(path, encoding="utf-8") as f:
                cfg = OmegaConf.load(f)
            assert type(cfg) is type(own) and OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(own), path
    f = tmp_path / "c.yaml"
    for text in ('a: 1\nb: [x, "${a}"]\n', "a: 2\n", ""):
        f.write_text(text)
        with open(f) as fh:
            cfg = OmegaConf.load(fh)
        assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(compose_cache.omegaconf_load(f))
    cfg.x = 1  # a caller's copy
    with open(f) as fh:
        assert "x" not in OmegaConf.load(fh)
    f.write_text("just text\n")
    with open(f) as fh:
        assert OmegaConf.load(fh) == compose_cache.omegaconf_load(f) == {"just text": None}
    f.write_text("a: 1\na: 2\n")
    with open(f) as fh, pytest.raises(yaml.constructor.ConstructorError, match=f"(?s)found duplicate key a.*{f.name}"):
        OmegaConf.load(fh)
