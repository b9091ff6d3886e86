"""Runs are named, tagged and labelled by the resolved values that ran, whatever override produced
them; two different configs never share a name; a sweep's group is its study + a unique id."""
import pytest
from omegaconf import OmegaConf

from normlab import identity
from normlab.commands.report_runs import Run

from conftest import compose_cfg


def describe(*overrides: str) -> tuple[str, dict, list[str], str]:
    cfg = compose_cfg(["logger=csv", *overrides])
    return identity.run_name(cfg), identity.labels(cfg), identity.tags(cfg, {}, list(overrides)), identity.identity_hash(cfg)


def test_a_group_choice_overridden_by_a_key_is_named_by_the_value_that_ran():
    name, labels, tags, h = describe("norm=prenorm", "norm.placement=post")
    assert labels["norm"] == "post_ln" and labels["arm"] == "post_ln" and labels["aggregation"] == "none"
    assert name.startswith("bible_de_en-post_ln-xavier-none-e3d3-s1-")
    assert {"norm:post_ln", "placement:post", "norm_type:layernorm", "norm.placement:post"} <= set(tags)
    assert not any("prenorm" in t or t == "norm:pre_ln" for t in tags)
    assert h == describe("norm=postnorm")[3]  # the same run, however it was spelled


def test_swept_keys_give_different_names_and_tags():
    a, _, tags_a, _ = describe("model.encoder_heads=4")
    b, _, tags_b, _ = describe("model.encoder_heads=2")
    assert a != b and a.rsplit("-", 1)[0] == b.rsplit("-", 1)[0]  # same readable part, different hash
    assert "model.encoder_heads:4" in tags_a and "model.encoder_heads:2" in tags_b


def test_an_explicit_name_keeps_the_hash():
    a, _, _, h = describe("name=mine", "seed=3")
    b, *_ = describe("name=mine", "seed=4")
    assert a == f"mine-{h}" and a != b


def test_identity_ignores_how_a_run_is_logged_or_executed_but_not_what_it_learns():
    h = describe()[3]
    assert describe("trainer.enable_progress_bar=false", "logger=wandb", "trainer.log_every_n_steps=1",
                    "trainer.max_time=00:00:01:00", "callbacks.full_checkpoint.every_n_steps=7")[3] == h
    assert describe("optim.lr=0.003")[3] == describe("optim.lr=3e-3")[3]  # resolved values, not spellings
    for changed in ("seed=2", "trainer.max_steps=10", "optim.warmup=10", "trainer.accumulate_grad_batches=2",
                    "trainer.precision=bf16-mixed", "data.max_tokens=1000", "eval.test_decoder.beam=5"):
        assert describe(changed)[3] != h, changed


@pytest.mark.parametrize("overrides, norm, init, reg, arm", [
    (["norm=scalenorm_fixnorm"], "pre_scalenorm_fixnorm", "xavier", "none", "pre_scalenorm_fixnorm"),
    (["+arm=admin"], "post_ln", "admin", "none", "admin"),
    (["+arm=admin", "init.admin.mode=closed_form"], "post_ln", "admin_closed_form", "none", "admin_closed_form"),
    (["+arm=admin", "init.admin.convention=authors"], "post_ln", "admin_authors", "none", "admin_authors"),
    (["norm=rmsnorm", "regularizer=layerdrop"], "pre_rmsnorm", "xavier", "layerdrop0.2", "pre_rmsnorm"),
    (["regularizer=layerdrop_drophead", "regularizer.decoder_layerdrop=0.1"], "pre_ln", "xavier",
     "layerdrop0.2-0.1+drophead0.2_v", "pre_ln"),
    (["regularizer=drophead", "callbacks.drophead_schedule.schedule=constant"], "pre_ln", "xavier", "drophead0.2",
     "pre_ln"),
    (["regularizer=layerdrop", "regularizer.encoder_layerdrop=0", "regularizer.decoder_layerdrop=0"], "pre_ln",
     "xavier", "none", "pre_ln"),
    (["+arm=deepnorm"], "deepnorm", "xavier", "none", "deepnorm"),
    (["+arm=rezero"], "rezero", "xavier", "none", "rezero"),
    (["+arm=subln", "norm.type=rmsnorm"], "subln_rmsnorm", "xavier", "none", "subln_rmsnorm"),
    (["+arm=pre_dyt"], "pre_dyt", "xavier", "none", "pre_dyt"),
    (["+arm=pre_derf"], "pre_derf", "xavier", "none", "pre_derf"),
    (["+arm=dlcl_pre"], "pre_ln", "xavier", "none", "dlcl_pre"),
    (["+arm=dlcl_post", "model.layer_aggregation_stacks=encoder"], "post_ln", "xavier", "none", "dlcl_encoder_post"),
])
def test_labels_from_resolved_values(overrides, norm, init, reg, arm):
    labels = describe(*overrides)[1]
    assert {k: labels[k] for k in ("norm", "init", "regularizer", "arm")} == {"norm": norm, "init": init,
                                                                             "regularizer": reg, "arm": arm}


def test_a_sweeps_group_is_its_study_and_an_id_of_its_definition():
    def study(task, sweep=None, params=None):
        cfg = OmegaConf.create({"hydra": {"runtime": {"choices": {"sweep": sweep, "experiment": None}},
                                          "sweeper": {"params": params}, "overrides": {"task": task}}})
        identity.SweepFolder().on_multirun_start(cfg)
        return identity.study_id()

    a = study(["norm=postnorm,prenorm", "model.encoder_heads=4,2"])
    assert a.startswith("multirun-") and a == study(["model.encoder_heads=2,4", "norm=prenorm,postnorm"])
    assert a == study(["norm=postnorm,prenorm", "model.encoder_heads=4,2", "logger=csv", "hydra/launcher=x"])
    assert a != study(["norm=postnorm,prenorm", "model.encoder_heads=4,2,1"])
    s = study(["+sweep=admin_depth"], sweep="admin_depth", params={"seed": "1,2"})
    assert s.startswith("admin_depth-") and s != study(["+sweep=admin_depth"], sweep="admin_depth", params={"seed": "1,2,3"})


def test_report_rows_use_the_labels_before_the_hydra_choice(tmp_path):
    run = Run(tmp_path, "completed", results={"labels": {"norm": "post_ln"}}, choices={"norm": "prenorm"})
    assert run.get("norm") == "post_ln"
    assert Run(tmp_path, "completed", choices={"norm": "prenorm"}).get("norm") == "prenorm"  # older runs


def test_names_tags_and_labels_say_the_corpus(tmp_path):
    from normlab.identity import data_label

    assert data_label({"name": "bible_fr_en"}) == "bible_fr_en"
    assert data_label({"path": "data-bin/wmt14_en_de/", "name": None}) == "wmt14_en_de"
    assert data_label({"name": "custom", "train_src": "data/iwslt14/train.de"}) == "iwslt14"
    assert data_label({"name": "custom", "train_src": "corpora/ted_talks.de.gz"}) == "ted_talks"
    assert data_label({"name": "custom", "train_src": "???"}) == "custom"
    name, labels, tags, _ = describe("data=preprocessed", f"data.path={tmp_path / 'ding_de_en'}")
    assert name.startswith("ding_de_en-pre_ln-") and labels["data"] == "ding_de_en"
    assert "data:ding_de_en" in tags


def test_a_run_is_resolved_once_before_its_folder_is_touched(tmp_path):
    """run_spec.resolve: the name, hash, labels and folder computed once from the resolved values; a
    bad value is one ConfigError before the folder exists."""
    import dataclasses

    from normlab.config import ConfigError
    from normlab.run_spec import resolve

    cfg = compose_cfg(["norm=postnorm", f"run_dir={tmp_path / 'run'}"])
    spec = resolve(cfg)
    assert spec.name == identity.run_name(cfg) and spec.identity_hash == identity.identity_hash(cfg)
    assert spec.labels["norm"] == "post_ln" and "norm:post_ln" in spec.tags and spec.run_dir == tmp_path / "run"
    assert not spec.resume and not spec.finetune and spec.start is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"
    with pytest.raises(ConfigError, match="optim.lr"):
        resolve(compose_cfg(["optim.lr=-1", f"run_dir={tmp_path / 'bad'}"]))
    assert not (tmp_path / "bad").exists()
