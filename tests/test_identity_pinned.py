"""Upgrades do not orphan runs: the names (identity hashes) of today's configs are pinned, so a sweep or
study started before a change continues after it. Values computed with the release of 2026-11-22
(4e4bf1d); a key added since at its neutral value (identity.NEUTRAL) leaves them unchanged.
A failure here means rerunning an old command would train its run again in a new folder: keep
the old identity (add the new key to identity.NEUTRAL) instead of updating the pin."""
import pytest
from hydra import compose, initialize_config_dir

from normlab import identity, resolvers, run_folder

from conftest import CONF

PINNED = [
    ([], "pre_ln-xavier-none-e3d3-s1-a59cc368"),
    (['norm=postnorm'], "post_ln-xavier-none-e3d3-s1-c4a44410"),
    (['+arm=admin', 'model.encoder_layers=18', 'model.decoder_layers=18'], "post_ln-admin-none-e18d18-s1-2af425b4"),
    (['regularizer=layerdrop', 'model.encoder_layers=6', 'model.decoder_layers=6'], "pre_ln-xavier-layerdrop0.2-e6d6-s1-eb66f56d"),
    (['regularizer=drophead', 'callbacks.drophead_schedule.schedule=constant'], "pre_ln-xavier-drophead0.2-e3d3-s1-f04cf34c"),
    (['experiment=deep_stack', '+arm=dlcl_post', 'seed=2'], "post_ln-xavier-dlcl-none-e18d18-s2-11f2a7ad"),
    (['norm=scalenorm_fixnorm', 'optim.warmup=0'], "pre_scalenorm_fixnorm-xavier-none-e3d3-s1-d1e673f4"),
    (['model=base', 'trainer=gpu'], "pre_ln-xavier-none-e6d6-s1-f43df415"),
    (['data=bible_fr_en', 'model=small'], "pre_ln-xavier-none-e6d6-s1-cc38be27"),
]


@pytest.mark.parametrize("overrides, name", PINNED)
def test_run_names_of_todays_configs_are_pinned(overrides, name):
    """The identity hash is the release's; the readable part now starts with the corpus."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    new = identity.run_name(cfg)
    corpus = "bible_fr_en" if "data=bible_fr_en" in overrides else "bible_de_en"
    assert new == f"{corpus}-{name}"


def test_folders_named_by_the_old_release_are_found(tmp_path):
    """A run folder named before the corpus was in names (same identity hash) is the one a rerun
    uses, as a single run (hydra.run.dir), in a sweep (its subdir) and in a study."""
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["norm=postnorm"], return_hydra_config=True)
    old = PINNED[1][1]
    (tmp_path / old).mkdir()
    (tmp_path / old / "run.json").write_text('{"identity_hash": "%s"}' % old.rsplit("-", 1)[1])
    assert resolvers._resolve_run_dir(str(tmp_path), _root_=cfg) == f"{tmp_path}/{old}"
    OmegaConf.update(cfg, "hydra.sweep.dir", str(tmp_path), force_add=True)
    assert resolvers._resolve_run_name(_root_=cfg) == old
    assert run_folder.existing_name(tmp_path / "elsewhere", "x-" + old.rsplit("-", 1)[1]) == "x-" + old.rsplit("-", 1)[1]
    # a folder with the hash but another identity in its run.json is not taken
    (tmp_path / "other-c4a44410").mkdir()
    (tmp_path / "other-c4a44410" / "run.json").write_text('{"identity_hash": "deadbeef"}')
    assert run_folder.existing_name(tmp_path, "new-c4a44410") in ("new-c4a44410", old)
    assert run_folder.existing_name(tmp_path, "new-c4a44410") == old


def test_a_new_key_at_its_neutral_value_keeps_the_identity():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        base = compose(config_name="config", overrides=[])
        on = compose(config_name="config", overrides=["callbacks.stall.stop_after=100"])
    assert identity.identity_hash(on) != identity.identity_hash(base)
    assert base.callbacks.stall.stop_after is None and identity.run_name(base) == "bible_de_en-" + PINNED[0][1]


def test_mix_ratio_at_its_default_keeps_the_pinned_names():
    """norm.mix_ratio (Mix-LN, issue 20) is in every composed config at 0.25 and leaves names alone."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        base = compose(config_name="config", overrides=["norm.mix_ratio=0.25"])
        post = compose(config_name="config", overrides=["norm=postnorm"])
        mix, mix_half = (compose(config_name="config", overrides=["norm=mix", *o]) for o in ([], ["norm.mix_ratio=0.5"]))
    assert base.norm.mix_ratio == post.norm.mix_ratio == 0.25
    assert identity.run_name(base) == "bible_de_en-" + PINNED[0][1]
    assert identity.run_name(post) == "bible_de_en-" + PINNED[1][1]
    assert identity.identity_hash(mix_half) != identity.identity_hash(mix)
    assert identity.run_name(mix).startswith("bible_de_en-mix-xavier-")


# Keys added by issues 20, 36 and 38, at their defaults: a pinned run keeps its name; another value is another run.
NEW_MODEL_KEYS = {"model.qk_norm": ("none", "l2"), "model.qk_norm_scale_init": ("null", "8.0"),
                  "model.value_residual": ("false", "true"), "model.residual": ("add", "hyper"),
                  "model.residual_streams": ("4", "2"), "model.residual_mixing": ("static", "dynamic"),
                  "model.bias": ("true", "false"),
                  # the attention-stability schemes (issue 38, model/stability.py)
                  "model.attn_gate": ("none", "headwise"), "model.attn_sink": ("false", "true"),
                  "model.attn_softcap": ("null", "50.0"), "model.logit_softcap": ("null", "30.0"),
                  "model.k_norm": ("false", "true"), "model.v_norm": ("false", "true")}


@pytest.mark.parametrize("key", NEW_MODEL_KEYS)
def test_a_new_model_key_at_its_default_keeps_the_pinned_names(key):
    from omegaconf import open_dict

    default, other = NEW_MODEL_KEYS[key]
    for overrides, name in PINNED[:2]:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            typed = compose(config_name="config", overrides=overrides + [f"{key}={default}"])
            changed = compose(config_name="config", overrides=overrides + [f"{key}={other}"])
        assert identity.run_name(typed) == "bible_de_en-" + name  # the key present, at its default
        with open_dict(typed):  # a config from before the key existed (an old checkpoint's model merged in)
            del typed.model[key.split(".", 1)[1]]
        assert identity.run_name(typed) == "bible_de_en-" + name
        assert identity.identity_hash(changed) != name.rsplit("-", 1)[1]



def test_valid_subset_at_its_default_keeps_the_pinned_names():
    """eval.valid_subset (issue 36) at null, or absent (a config from before it), names every pinned run
    as before; a subset is another run (its best checkpoint is chosen on other sentences)."""
    from omegaconf import open_dict

    for overrides, name in PINNED:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            typed = compose(config_name="config", overrides=overrides + ["eval.valid_subset=null"])
            subset = compose(config_name="config", overrides=overrides + ["eval.valid_subset=200"])
        corpus = "bible_fr_en" if "data=bible_fr_en" in overrides else "bible_de_en"
        assert typed.eval.valid_subset is None and identity.run_name(typed) == f"{corpus}-{name}"
        with open_dict(typed):
            del typed.eval["valid_subset"]
        assert identity.run_name(typed) == f"{corpus}-{name}"
        assert identity.identity_hash(subset) != name.rsplit("-", 1)[1]

def test_a_started_run_is_named_alike_by_its_folder_and_its_record(tmp_path):
    """finetune=/resume= with a checkpoint whose model changes a key that others interpolate
    (data.max_positions follows model.max_positions; callbacks.drophead_schedule.p follows
    regularizer.drophead): the folder (the Hydra resolver) and run.json (run_spec.resolve) carry one
    name. A folder an earlier release named the other way is still the one the command continues."""
    import torch

    from normlab.run_spec import resolve

    weights = tmp_path / "w.ckpt"
    torch.save({"model_config": {"max_positions": 64, "regularizer": {"drophead": 0.2}}, "state_dict": {}}, weights)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"finetune={weights}"], return_hydra_config=True)
    folder = resolvers._resolve_run_dir(str(tmp_path / "outputs"), _root_=cfg)
    spec = resolve(compose_job(cfg, tmp_path / 'run'))
    assert folder == f"{tmp_path}/outputs/{spec.name}"
    # the release before named it from the resolved tree with the checkpoint's values set on it
    name, legacy = resolvers._folder_names(cfg)
    assert name == spec.name and legacy != name and legacy.rsplit("-", 1)[0] == name.rsplit("-", 1)[0]
    (tmp_path / "outputs" / legacy).mkdir(parents=True)
    (tmp_path / "outputs" / legacy / "run.json").write_text('{"identity_hash": "%s"}' % spec.identity_hash)
    assert resolvers._resolve_run_dir(str(tmp_path / "outputs"), _root_=cfg) == f"{tmp_path}/outputs/{legacy}"
    # a folder of the old name that holds another run is not taken
    (tmp_path / "outputs" / legacy / "run.json").write_text('{"identity_hash": "deadbeef"}')
    assert resolvers._resolve_run_dir(str(tmp_path / "outputs"), _root_=cfg) == f"{tmp_path}/outputs/{name}"
    (tmp_path / "outputs" / legacy / "run.json").write_text('{"identity_hash": "%s"}' % spec.identity_hash)
    # once a folder of the right name exists, it is the one
    (tmp_path / "outputs" / name).mkdir()
    assert resolvers._resolve_run_dir(str(tmp_path / "outputs"), _root_=cfg) == f"{tmp_path}/outputs/{name}"


def compose_job(cfg, run_dir):
    """The job's config as train.run resolves it: a copy (resolve merges the checkpoint's model into
    it), its typed overrides in its hydra node, its folder given."""
    import copy

    from omegaconf import open_dict

    job = copy.deepcopy(cfg)
    with open_dict(job):
        job.run_dir = str(run_dir)
    return job


@pytest.mark.parametrize("max_steps, interval", [(2000, 500), (4000, 500), (600, 150), (200, 50), (30, 7), (12, 5), (3, 5),
                                                 (-1, 500)])
def test_validation_interval_follows_max_steps(max_steps, interval):
    """At least 4 validations a run of 20 steps or more (a 600-step run validated once, a 200-step run
    never), at most one every 5 steps (each is a full decode)."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"trainer.max_steps={max_steps}"])
    assert cfg.trainer.val_check_interval == interval


def test_runs_named_before_the_defaults_changed_are_found_with_the_old_values():
    """A 600-step run started when the interval was 500 (and a preprocessed run when max_tokens
    was 4096) keeps its name: the old values typed give the old identity hash."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        short_then = compose(config_name="config", overrides=["trainer.max_steps=600", "trainer.val_check_interval=500"])
        short_now = compose(config_name="config", overrides=["trainer.max_steps=600"])
        pre_then = compose(config_name="config", overrides=["data=preprocessed", "data.path=/d/wmt", "data.max_tokens=4096"])
    # computed with the code before the defaults changed (8d210af)
    assert identity.identity_hash(short_then) == "5290d4e3" != identity.identity_hash(short_now)
    assert identity.identity_hash(pre_then) == "747074d5"


def test_text_and_preprocessed_corpora_batch_alike_by_default():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        text = compose(config_name="config", overrides=[]).data
        pre = compose(config_name="config", overrides=["data=preprocessed", "data.path=/d/x"]).data
    for key in ("max_tokens", "eval_max_tokens", "max_positions", "seed", "num_workers"):
        assert text[key] == pre[key], key


def test_attention_options_are_in_the_names_and_arm_labels():
    """QK-norm and the value residual change what a run is: its name and arm label say so (a run
    without them is named as before: see the pins above)."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        qk = compose(config_name="config", overrides=["+arm=pre_qk_norm"])
        vr = compose(config_name="config", overrides=["+arm=pre_value_residual", "model.qk_norm=rms"])
    assert identity.run_name(qk).startswith("bible_de_en-pre_ln-xavier-qk_l2-none-e3d3-s1-")
    assert identity.labels(qk)["arm"] == "pre_ln+qk_l2" and identity.labels(vr)["arm"] == "pre_ln+qk_rms+vres"
    assert identity.run_name(vr).startswith("bible_de_en-pre_ln-xavier-qk_rms+vres-none-e3d3-s1-")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        hyper = compose(config_name="config", overrides=["+arm=hyper"])
        mhc = compose(config_name="config", overrides=["+arm=mhc"])
    assert identity.labels(hyper)["arm"] == "pre_ln+hyper4" and identity.labels(mhc)["arm"] == "pre_ln+mhc4_dynamic"
    assert identity.run_name(mhc).startswith("bible_de_en-pre_ln-xavier-mhc4_dynamic-none-e3d3-s1-")


def test_the_attention_stability_schemes_are_named_so():
    """Each scheme of issue 38 is in the run's name and arm (off: today's names, pinned above)."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        gated = compose(config_name="config", overrides=["model.attn_gate=elementwise", "model.attn_sink=true"])
        capped = compose(config_name="config", overrides=["model.attn_softcap=50", "model.logit_softcap=30.0",
                                                          "model.k_norm=true", "model.v_norm=true", "model.bias=false"])
    assert identity.run_name(gated).startswith("bible_de_en-pre_ln-xavier-gate_elementwise+sink-none-e3d3-s1-")
    assert identity.labels(capped)["arm"] == "pre_ln+nobias+acap50+ocap30+knorm+vnorm"


def test_a_bias_free_model_is_named_so():
    """model.bias=false (issue 36) is another run, and its name and arm say nobias; true is today's."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        nobias = compose(config_name="config", overrides=["model.bias=false"])
        post = compose(config_name="config", overrides=["norm=postnorm", "model.bias=false", "model.qk_norm=l2"])
        today = compose(config_name="config", overrides=["model.bias=true"])
    assert identity.run_name(today) == "bible_de_en-" + PINNED[0][1] and identity.labels(today)["attention"] == "none"
    assert identity.run_name(nobias).startswith("bible_de_en-pre_ln-xavier-nobias-none-e3d3-s1-")
    assert identity.identity_hash(nobias) != PINNED[0][1].rsplit("-", 1)[1]
    assert identity.labels(nobias)["arm"] == "pre_ln+nobias" and identity.labels(post)["arm"] == "post_ln+nobias+qk_l2"
    assert identity.run_name(post).startswith("bible_de_en-post_ln-xavier-nobias+qk_l2-none-e3d3-s1-")


def test_the_report_resolves_a_runs_saved_interval():
    """Hydra saves a run's config unresolved (.hydra/config.yaml): the report command registers the
    resolver, so a 600-step run's interval reads 150, not the interpolation text."""
    import subprocess
    import sys

    code = ("import normlab.commands.report_runs; from omegaconf import OmegaConf; "
            "c = OmegaConf.create({'trainer': {'max_steps': 600, 'val_check_interval': "
            "'${nl.val_interval:${trainer.max_steps}}'}}); print(OmegaConf.to_container(c, resolve=True))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "'val_check_interval': 150" in out


# debug=profiler too, but its identity reads Hydra's output folder (trainer.profiler.dirpath), known in a Hydra run only
@pytest.mark.parametrize("mode", ["fdr", "limit", "overfit"])
def test_debug_runs_are_named_apart_and_the_default_run_is_not(mode, tmp_path):
    """A debug run has no checkpoint and is never continued: its folder is debug-<mode>-<run name>, which a
    glob for the run it debugs (README: outputs/bible_de_en-pre_ln-xavier-none-e3d3-s1-*) never finds, and
    a folder an earlier release gave it (the same hash, the default run's readable part) is not taken."""
    import fnmatch

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        default = compose(config_name="config", overrides=[])
        debug = compose(config_name="config", overrides=[f"debug={mode}"], return_hydra_config=True)
    assert identity.run_name(default) == "bible_de_en-" + PINNED[0][1]  # unchanged
    name = identity.run_name(debug)
    digest = identity.identity_hash(debug)
    assert name == f"debug-{mode}-bible_de_en-pre_ln-xavier-none-e3d3-s1-{digest}"
    assert not fnmatch.fnmatch(name, "bible_de_en-pre_ln-xavier-none-e3d3-s1-*")
    old = f"bible_de_en-pre_ln-xavier-none-e3d3-s1-{digest}"  # the name the release before gave it
    (tmp_path / old).mkdir()
    (tmp_path / old / "run.json").write_text('{"identity_hash": "%s"}' % digest)
    assert resolvers._resolve_run_dir(str(tmp_path), _root_=debug) == f"{tmp_path}/{name}"


def test_labels_are_not_identity():
    """What a run is part of (a study, its arm and budget; set by normlab-study) leaves its name and hash
    alone, so a committed study record is found again and two studies share a run (test_study.py checks
    every record against the plan, which composes the labels)."""
    for overrides, name in PINNED:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            labelled = compose(config_name="config", overrides=overrides + [
                "labels.study=twt_lowres", "labels.arm=post_ln_lr2e-3", "labels.budget=smoke"])
        corpus = "bible_fr_en" if "data=bible_fr_en" in overrides else "bible_de_en"
        assert identity.run_name(labelled) == f"{corpus}-{name}"
    lab = identity.labels(labelled)
    assert (lab["study"], lab["arm"], lab["budget"], lab["scheme"]) == ("twt_lowres", "post_ln_lr2e-3", "smoke", "pre_ln")
    tags = identity.tags(labelled, {}, ["labels.arm=post_ln_lr2e-3", "optim.lr=0.002"])
    assert {"study:twt_lowres", "arm:post_ln_lr2e-3", "scheme:pre_ln", f"optim.lr:{labelled.optim.lr}"} <= set(tags)
    assert not [t for t in tags if t.startswith(("labels.", "arm:pre_ln"))]  # tagged once, as the study's arm
    assert "scheme" not in identity.labels(default_config())  # a run outside a study: labels as before


def default_config():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=[])


def test_only_a_runs_own_labels_reach_its_labels_and_name():
    """`labels` is not identity: +labels.norm=x must neither rename the run nor change its labels
    (a new folder name with the same hash); labels.arm (normlab-study) does set the arm."""
    from normlab import identity

    from conftest import compose_cfg

    plain = compose_cfg([])
    odd = compose_cfg(["+labels.norm=odd", "+labels.data=odd"])
    assert identity.run_name(odd) == identity.run_name(plain)
    assert identity.labels(odd) == identity.labels(plain)
    study = compose_cfg(["labels.arm=post_ln_lr2e-3"])
    assert identity.labels(study)["arm"] == "post_ln_lr2e-3"
    assert identity.run_name(study) == identity.run_name(plain)
