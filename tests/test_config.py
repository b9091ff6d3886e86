"""Invalid configuration values fail before any work, naming the key and the allowed values."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from normlab.config import ConfigError, ModelConfig, NormConfig
from normlab.run_config import validate_run_config

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=False)


def test_default_config_is_valid():
    m = validate_run_config(cfg_with())
    assert (m.d_model, m.encoder_layers, m.norm.placement) == (128, 3, "pre")


@pytest.mark.parametrize("override, pattern", [
    ("norm.type=batchnorm", r"^norm\.type: 'batchnorm' is not valid \(allowed: layernorm, scalenorm, rmsnorm, dyt, derf, none\)$"),
    ("norm.placement=middle", r"^norm\.placement: 'middle' is not valid \(allowed: post, pre, "),
    ("model.d_model=130", r"^model\.d_model: 130 is not divisible by model\.encoder_heads=4$"),
    ("model.dropout=-0.1", r"^model\.dropout: -0\.1 is not valid \(allowed: a probability in \[0, 1\]\)$"),
    ("model.encoder_layers=0", r"^model\.encoder_layers: 0 is not valid \(allowed: an integer > 0\)$"),
    ("optim.lr=-1", r"^optim\.lr: -1 "),
    ("optim.label_smoothing=1.5", r"^optim\.label_smoothing: 1\.5 "),
    ("eval.decoder.beam=0", r"^eval\.decoder\.beam: 0 "),
    ("+model.colour=red", r"^model\.colour: not a model option \(allowed: .*d_model"),
    # the cases of issue 11: each names its key, before any data is read
    ("seed=abc", r"^seed: 'abc' is not valid \(allowed: an integer in \[0, 2\*\*32 - 1\]\)$"),
    ("data.vocab_size=0", r"^data\.vocab_size: 0 "),
    ("eval.decoder.lenpen=abc", r"^eval\.decoder\.lenpen: 'abc' "),
    ("eval.test_decoder.lenpen=abc", r"^eval\.test_decoder\.lenpen: 'abc' "),
    ("+eval.decoder.beam_size=4", r"^eval\.decoder\.beam_size: not a decoder option \(allowed: beam, lenpen"),
    ("trainer.val_check_interval=0", r"^trainer\.val_check_interval: 0 "),
    ("trainer.val_check_interval=1.5", r"^trainer\.val_check_interval: 1\.5 "),
    ("data.max_tokens=10", r"^data\.max_tokens: 10 cannot hold a pair of model\.max_positions=256 tokens"),
    ("+trainer.fast_dev_runs=1", r"^trainer\.fast_dev_runs: not a lightning\.Trainer argument"),
    ("trainer.precision=17", r"^trainer\.precision: 17 is not valid \(allowed: 32-true"),
    ("trainer.limit_val_batches=-2", r"^trainer\.limit_val_batches: -2 "),
    ("optim.betas=[0.9]", r"^optim\.betas: "),
    ("norm.fixnorm=maybe", r"^norm\.fixnorm: 'maybe' is not valid \(allowed: true, false\)$"),
    ("callbacks.step_checkpoints.keep_last_n=-1", r"^callbacks\.step_checkpoints\.keep_last_n: -1 "),
    ("data=custom", r"^data\.train_src: no value given .*also missing: data\.train_tgt, data\.valid_src"),
    ("norm.placement=rezero", r"^norm\.type: layernorm with norm\.placement=rezero"),
    ("model.layer_aggregation=dense", r"^model\.layer_aggregation: 'dense' is not valid \(allowed: none, dlcl, dwa, attnres\)$"),
    ("+norm.colour=red", r"^norm\.colour: not a norm option"),
    ("model.qk_norm=cosine", r"^model\.qk_norm: 'cosine' is not valid \(allowed: none, l2, rms\)$"),
    ("model.qk_norm_scale_init=0", r"^model\.qk_norm_scale_init: 0 is not valid \(allowed: a number > 0, or null"),
    ("model.value_residual=maybe", r"^model\.value_residual: 'maybe' is not valid \(allowed: true, false\)$"),
    ("model.bias=maybe", r"^model\.bias: 'maybe' is not valid \(allowed: true, false\)$"),
    ("model.residual=dense", r"^model\.residual: 'dense' is not valid \(allowed: add, hyper, mhc\)$"),
    ("model.residual_streams=2", r"^model\.residual_streams: 2 with model\.residual=add: only hyper and mhc read it"),
    ("model.residual_mixing=sometimes", r"^model\.residual_mixing: 'sometimes' is not valid \(allowed: static, dynamic\)$"),
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


def test_the_v_shaped_drophead_schedule_needs_a_last_step():
    """Zhou et al. 2020's V rises to p at the run's last step: with trainer.max_steps=-1 (and no
    callbacks.drophead_schedule.total) there is none. One line naming both keys, before any data
    (was: a ValueError traceback at the first training batch, after the corpus was read)."""
    with pytest.raises(ConfigError) as err:
        validate_run_config(cfg_with("regularizer=drophead", "trainer.max_steps=-1"))
    assert str(err.value) == (
        "callbacks.drophead_schedule.schedule=v_shape: its rate rises to regularizer.drophead at the last step, and "
        "trainer.max_steps=-1 sets none (allowed: trainer.max_steps=N, callbacks.drophead_schedule.total=N, or "
        "callbacks.drophead_schedule.schedule=constant)")
    for usable in (["trainer.max_steps=-1", "+callbacks.drophead_schedule.total=500"],
                   ["trainer.max_steps=-1", "callbacks.drophead_schedule.schedule=constant"],
                   ["trainer.max_steps=-1", "regularizer.drophead=0.0"], ["trainer.max_steps=100"]):
        validate_run_config(cfg_with("regularizer=drophead", *usable))
