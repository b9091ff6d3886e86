"""Invalid configuration values fail before any work, naming the key and the allowed values."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from normlab.config import ConfigError, ModelConfig, NormConfig, validate_run_config

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=False)


def test_default_config_is_valid():
    m = validate_run_config(cfg_with())
    assert (m.d_model, m.encoder_layers, m.norm.placement) == (128, 3, "pre")


@pytest.mark.parametrize("override, pattern", [
    ("norm.type=batchnorm", r"norm\.type='batchnorm'.*layernorm, scalenorm, rmsnorm"),
    ("norm.placement=middle", r"norm\.placement='middle'.*post, pre"),
    ("model.d_model=130", r"model\.d_model=130 is not divisible by model\.encoder_heads=4"),
    ("model.dropout=-0.1", r"model\.dropout=-0\.1"),
    ("model.encoder_layers=0", r"model\.encoder_layers=0 must be a positive integer"),
    ("optim.lr=-1", r"optim\.lr=-1"),
    ("optim.label_smoothing=1.5", r"optim\.label_smoothing"),
    ("eval.decoder.beam=0", r"eval\.decoder\.beam"),
    ("+model.colour=red", r"model\.colour is not a model option"),
    ("norm.placement=rezero", r"norm\.type=layernorm with norm\.placement=rezero"),
    ("model.layer_aggregation=dense", r"model\.layer_aggregation='dense' is not valid; allowed values: none, dlcl"),
    ("+norm.colour=red", r"norm\.colour is not a norm option"),
])
def test_invalid_values_name_the_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_run_config(cfg_with(override))


def test_unknown_group_option_lists_the_choices():
    with pytest.raises((ConfigCompositionException, MissingConfigException), match="prenorm"):
        cfg_with("norm=sideways")


@pytest.mark.parametrize("preset", ["tiny", "small", "base", "big"])
def test_model_presets_compose(preset):
    m = validate_run_config(cfg_with(f"model={preset}"))
    if preset == "base":
        assert (m.d_model, m.encoder_ffn, m.encoder_heads, m.dropout) == (512, 2048, 8, 0.1)
    if preset == "big":
        assert (m.d_model, m.encoder_ffn, m.encoder_heads, m.dropout) == (1024, 4096, 16, 0.3)


def test_model_config_round_trip():
    m = ModelConfig(vocab_size=50, norm=NormConfig(type="rmsnorm", placement="pre"))
    assert ModelConfig.from_dict(m.to_dict()) == m


def test_scheme_overrides_from_the_command_line():
    m = validate_run_config(cfg_with("model.layer_aggregation=dlcl", "norm.placement=deepnorm"))
    assert (m.layer_aggregation, m.layer_aggregation_stacks, m.norm.placement) == ("dlcl", "both", "deepnorm")
    assert validate_run_config(cfg_with("norm=rezero")).norm.type == "none"
