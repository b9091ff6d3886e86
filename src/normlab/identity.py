"""What a run is, from the resolved values that ran: its identity, name, labels and W&B tags.

Hydra's choice names say which file a value came from, not what ran: `norm=prenorm
norm.placement=post` is a post-norm run. So everything a user or the report reads about a run is
computed here from resolved values:

- identity(cfg): the resolved config minus the keys in NOT_IDENTITY (where and how a run is
  executed or logged, never what it learns or how it is scored). Two configs with the same identity
  are the same run: rerunning continues it in the same folder.
- run_name(cfg): a readable part built from labels (norm, init, regularizer, depths, seed), or the
  `name` you give, plus 8 hex digits of the identity's hash, so two different configs never share a
  name (and so never a folder).
- labels(cfg): the report's row values and the W&B tags for norm / init / regularizer / arm, and
  what the run is part of (the config's `labels`: a study's name, arm and budget; a debug mode).
- study_id(): a sweep's folder and W&B group, `<study>-<hash of the sweep's definition>`.

Pure functions of the resolved values: nothing here reads a file or Hydra's state. A run's identity
is assembled from them once, with a start checkpoint's model merged in and its folder found, by
run_identity.identify (which the resolvers naming a run's folder, `nl.run_name` / `nl.run_dir`, call);
`nl.study` is `study_id` below.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from normlab.model.scheme_labels import NAMED_WITH_NORM  # torch-free: the label rule of the schemes

# Keys that do not change what a run learns or how it is scored. Everything else is identity
# (model, norm, regularizer, init, optim, data, seed, budget, precision, devices x accumulation,
# evaluation), so a key added later is identity unless it is listed here.
NOT_IDENTITY = (
    "name", "group", "tags", "project", "run_dir", "retrain",  # labels and the folder itself
    "labels",  # what a run is part of (a study and its arm, a debug mode): the same run in two studies is one run
    "logger", "loggers",  # where metrics go
    "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.log_every_n_steps",
    "trainer.accelerator", "trainer.strategy",  # where the same computation runs
    "trainer.max_time",  # a cap on one invocation: a rerun continues the run
    "data.cache_dir", "data.num_workers", "model.compile",  # torch.compile: how the same model runs
    "callbacks.train_log", "callbacks.progress_bar",  # what the console shows
    "callbacks.diagnostics",  # extra logging (eval mode, own generator: no effect on training)
    "callbacks.observatory",  # extra logging (eval mode on one validation batch, no random draw)
    "callbacks.full_checkpoint", "callbacks.preemption",  # when state is saved, not what is trained
)
# Keys added after runs were named, at the value that behaves as before: left out of the identity at
# that value, so the runs named before the key existed are still found (continued or skipped).
NEUTRAL = {
    "callbacks.stall.stop_after": None,  # stopping stalled runs early (off)
    "norm.mix_ratio": 0.25,  # Mix-LN's α (issue 20), read by norm.placement=mix alone; its default
    # validating at the last step too: a run whose max_steps is a multiple of the validation
    # interval (every preset and study) behaves as before; another continued across the change
    # validates at its end as well, which only adds a candidate for its best checkpoint
    "callbacks.validate_at_end": {"_target_": "normlab.callbacks.validate_at_end.ValidateAtEnd"},
    "model.qk_norm": "none",  # QK-norm (issue 20): off, attention as before
    "model.qk_norm_scale_init": None,  # its g₀ (the paper's rule); acts only with qk_norm=l2
    "model.value_residual": False,  # value residual (issue 20): off
    "model.residual": "add",  # hyper-connections (issue 20): off, one residual stream
    "model.residual_streams": 4,  # their n; read by residual=hyper|mhc alone
    "model.residual_mixing": "static",  # their static / dynamic weights; read by hyper|mhc alone
    "model.bias": True,  # biases in attention projections and norms (issue 36): as every run before
    # training to a plateau (issue 35): off, every run trains to max_steps as before
    "callbacks.plateau": {"_target_": "normlab.callbacks.plateau.PlateauStop", "window": None, "min_delta": 0.01,
                          "monitor": "valid/loss"},
    "eval.valid_subset": None,  # validation BLEU on a subset of the valid set (issue 36): off, all of it
    "optim.optimizer": "adam",  # AdamW's parameter groups (issue 38): off, Adam on every parameter as before
    "optim.no_decay": ["embeddings", "gains", "biases", "scheme"],  # read by optimizer=adamw alone
    "optim.z_loss": 0.0,  # the output softmax's z-loss (issue 38): off
    # the attention-stability schemes (issue 38, model/stability.py): each off, attention and logits as before
    "model.attn_gate": "none", "model.attn_sink": False, "model.attn_softcap": None, "model.logit_softcap": None,
    "model.k_norm": False, "model.v_norm": False,
    "optim.skip_spikes": None,  # skipping updates whose gradient norm spikes (issue 38): off
    "optim.spike_window": 100,  # its window; read with skip_spikes alone
    "model.attnres_block": 1,  # Attention Residuals' block size (issue 38); read by layer_aggregation=attnres alone
}
HASH_LEN = 8
NORM_SHORT = {"layernorm": "ln", "scalenorm": "scalenorm", "rmsnorm": "rmsnorm"}


def plain(cfg: Any) -> dict:
    """The resolved task config as plain data, without Hydra's own node. A run started from a
    checkpoint (resume= / finetune=) is named as the model it continues: run_identity.identify merges
    the checkpoint's model settings in first."""
    if not OmegaConf.is_config(cfg):
        return dict(cfg)
    # cfg[k] of a dict or list is its node, unresolved (to_container resolves it against the whole
    # config); of a value, the value resolved
    return {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for k, v in ((k, cfg[k]) for k in cfg if k != "hydra")}


def set_key(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def start_checkpoint(cfg: Any) -> str | None:
    return cfg.get("finetune") or cfg.get("resume")


def _drop(tree: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.get(p) if isinstance(tree, dict) else None
        if not isinstance(tree, dict):
            return
    tree.pop(leaf, None)


def _get(tree: dict, dotted: str, missing: Any) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return missing
        tree = tree[part]
    return tree


def identity(cfg: Any) -> dict:
    out = plain(cfg)
    for key in NOT_IDENTITY:
        _drop(out, key)
    missing = object()
    for key, neutral in NEUTRAL.items():
        if _get(out, key, missing) == neutral:
            _drop(out, key)
    return out


def identity_hash(cfg: Any) -> str:
    text = json.dumps(identity(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LEN]


def _num(x: Any) -> str:
    return f"{float(x):g}"


def norm_label(norm: Any) -> str:
    """pre_ln, post_ln, pre_scalenorm_fixnorm, pre_dyt, deepnorm, rezero, subln_rmsnorm, ... (the arm
    names of conf/arm/): placement and type; a scheme's own placement name stands alone with
    LayerNorm (or no norm, ReZero's)."""
    placement, t = norm.get("placement", "post"), norm.get("type", "layernorm")
    plain = placement not in NAMED_WITH_NORM and t in ("layernorm", "none")
    return (placement if plain else f"{placement}_{NORM_SHORT.get(t, t)}") + ("_fixnorm" if norm.get("fixnorm") else "")


def init_label(init: Any) -> str:
    init = init or {}
    name = init.get("name", "xavier")
    admin = (init.get("admin") or {}) if name == "admin" else {}
    extras = [admin[k] for k, default in (("mode", "profile"), ("convention", "paper")) if admin.get(k, default) != default]
    return "_".join([name, *extras])


def aggregation_label(model: Any) -> str:
    """none, dlcl, dlcl_encoder, dlcl_decoder (Wang et al. 2019's layer aggregation); dwa, dwa_encoder,
    dwa_decoder (DenseFormer, Pagliardini et al. 2024)."""
    agg, stacks = model.get("layer_aggregation") or "none", model.get("layer_aggregation_stacks") or "both"
    block = model.get("attnres_block") or 1
    agg = agg if block == 1 else f"{agg}{block}"  # Block AttnRes: attnres4 (layers per block)
    return agg if agg == "none" or stacks == "both" else f"{agg}_{stacks}"


def regularizer_label(reg: Any, drophead_schedule: str | None = None) -> str:
    reg = reg or {}
    enc, dec, dh = (float(reg.get(k) or 0.0) for k in ("encoder_layerdrop", "decoder_layerdrop", "drophead"))
    parts = []
    if enc or dec:
        rates = _num(enc) if enc == dec else f"{_num(enc)}-{_num(dec)}"
        parts.append(f"layerdrop{rates}" + ("_learned" if reg.get("layerdrop_rates") == "learned" else ""))
    if dh:
        parts.append(f"drophead{_num(dh)}" + ("_v" if drophead_schedule == "v_shape" else ""))
    return "+".join(parts) or "none"


GENERIC_STEMS = ("train", "training", "corpus", "data", "bitext")


def data_label(data: Any) -> str:
    """The corpus a run trained on: the data config's name (bible_de_en), a preprocessed folder's
    name (data.path's last part), or a custom corpus's stem (its folder's name when the files are
    just train.<lang>)."""
    data = data or {}
    if data.get("path"):  # data=preprocessed
        return Path(str(data["path"]).rstrip("/")).name or "preprocessed"
    name = data.get("name")
    if name and name != "custom":
        return str(name)
    src = data.get("train_src")
    if not src or str(src) == "???":
        return str(name or "custom")
    p = Path(str(src))
    stem = p.name.split(".", 1)[0]
    return p.parent.name if stem.lower() in GENERIC_STEMS and p.parent.name else stem


def attention_label(model: Any) -> str:
    """What the attention and the residual stream add to the scheme (issue 20): QK-norm (qk_l2,
    qk_rms), the value residual (vres) and hyper-connections (hyper4, mhc4_dynamic: n streams),
    and what they remove (issue 36: nobias, model.bias=false), "+"-joined; "none" for today's model
    (so no earlier run's name changes)."""
    parts = ["nobias"] if model.get("bias", True) is False else []
    parts += [f"qk_{model['qk_norm']}"] if model.get("qk_norm") not in (None, "none") else []
    parts += ["vres"] if model.get("value_residual") else []
    parts += stability_parts(model)
    if model.get("residual") not in (None, "add"):
        dynamic = "_dynamic" if model.get("residual_mixing") == "dynamic" else ""
        parts.append(f"{model['residual']}{model.get('residual_streams')}{dynamic}")
    return "+".join(parts) or "none"


def stability_parts(model: Any) -> list[str]:
    """The attention-stability schemes a model uses (issue 38): gate_headwise, gate_elementwise, sink,
    acap50 (attention-logit cap c), ocap30 (output-logit cap), knorm, vnorm."""
    gate = model.get("attn_gate")
    parts = [f"gate_{gate}"] if gate not in (None, "none") else []
    parts += ["sink"] if model.get("attn_sink") else []
    parts += [f"{p}cap{_num(model[k])}" for p, k in (("a", "attn_softcap"), ("o", "logit_softcap"))
              if model.get(k) is not None]
    return parts + [k.replace("_", "") for k in ("k_norm", "v_norm") if model.get(k)]


RUN_LABELS = ("study", "arm", "budget", "debug")  # the config's `labels` a run carries (normlab-study, debug=)


def labels(cfg: Any) -> dict[str, str]:
    """Row values for the report and W&B tags, from resolved values; with the config's `labels` that
    are set (study, arm, budget, debug). A study's arm is the run's arm (its three learning-rate arms
    of one scheme are three rows, not one), and the arm the resolved values name is kept as `scheme`."""
    c = plain(cfg)
    # only these: `labels` is not identity, so a label the run name is built from (norm, data, ...)
    # must come from the resolved values, never from +labels.norm=... (a new name, the same hash)
    given = {k: str(v) for k, v in (c.get("labels") or {}).items() if v is not None and k in RUN_LABELS}
    norm, init = norm_label(c.get("norm") or {}), init_label(c.get("init"))
    agg = aggregation_label(c.get("model") or {})
    # An arm is a norm + init (+ aggregation) combination; post-LN with Admin's init is what Liu et
    # al. 2020 call "Admin"; DLCL arms are dlcl_pre / dlcl_post, DenseFormer's dwa_pre (conf/arm/).
    arm = norm if init == "xavier" else (init if norm == "post_ln" else f"{norm}+{init}")
    if agg != "none":
        arm = f"{agg}_{arm.removesuffix('_ln')}"
    attention = attention_label(c.get("model") or {})
    if attention != "none":  # conf/arm/pre_qk_norm, pre_value_residual, hyper: pre_ln+qk_l2, pre_ln+hyper4
        arm = f"{arm}+{attention}"
    schedule = ((c.get("callbacks") or {}).get("drophead_schedule") or {}).get("schedule")
    out = {"norm": norm, "init": init, "aggregation": agg, "attention": attention,
           "regularizer": regularizer_label(c.get("regularizer"), schedule), "arm": arm, "data": data_label(c.get("data"))}
    if "arm" in given:
        out["scheme"] = arm
    return out | given


STUDY_GROUP_PREFIX = "study-"  # a study's runs' W&B group: study-<name>[-<budget>]


def study_group(study: str, budget: str | None = None) -> str:
    """A study's W&B group: `study-<name>`, and `study-<name>-<budget>` for another budget than the full
    one, so a smoke test's runs never land in the real study's group (records name their study's
    runs by the full budget's group: study/runner.shared_index)."""
    return f"{STUDY_GROUP_PREFIX}{study}" + (f"-{budget}" if budget not in (None, "full") else "")


def debug_mode(cfg: Any) -> str | None:
    """The debug option a run was started with (conf/debug sets labels.debug), else None."""
    return (plain(cfg).get("labels") or {}).get("debug")


def run_name(cfg: Any) -> str:
    """`<name or labels>-<identity hash>`: readable, and never shared by two different configs. A
    debug run's starts with `debug-<mode>-`: it has no checkpoint and is never continued, so a glob
    for the run it debugs (the README's `RUN=$(ls -d outputs/bible_de_en-pre_ln-...-s1-* | head -1)`)
    must not find it."""
    c = plain(cfg)
    given = c.get("name")
    if given:
        readable = str(given)
    else:
        lab, m = labels(c), c.get("model") or {}
        agg = "".join(f"-{lab[k]}" for k in ("aggregation", "attention") if lab[k] != "none")
        readable = (f"{lab['data']}-{lab['norm']}-{lab['init']}{agg}-{lab['regularizer']}-"
                    f"e{m.get('encoder_layers')}d{m.get('decoder_layers')}-s{c.get('seed')}")
    debug = debug_mode(c)
    readable = f"debug-{debug}-{readable}" if debug else readable
    return f"{_safe(readable)}-{identity_hash(c)}"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+=,-]+", "_", text).strip("_") or "run"


PATH_HINTS = ("_src", "_tgt", "dir", "path", "file", "resume", "finetune")


def tags(cfg: Any, choices: dict, overrides: list[str], values: dict | None = None) -> list[str]:
    """W&B tags: the labels, placement / norm type / FixNorm, depths, seed, the preset choices, and
    `key:value` (resolved) for every key set on the command line or by a sweep, paths excepted.
    `values`: plain(cfg), when the caller has it (resolving the config again costs ~10 ms)."""
    c = plain(cfg if values is None else values)
    lab, n, m = labels(c), c.get("norm") or {}, c.get("model") or {}
    out = [f"{k}:{v}" for k, v in lab.items()]
    out += [f"placement:{n.get('placement')}", f"norm_type:{n.get('type')}", f"fixnorm:{bool(n.get('fixnorm'))}",
            f"enc:{m.get('encoder_layers')}", f"dec:{m.get('decoder_layers')}", f"seed:{c.get('seed')}"]
    out += [f"{g}:{choices[g]}" for g in ("model", "experiment", "sweep") if choices.get(g)]
    if choices.get("data") and choices["data"] != lab["data"]:  # data:<corpus> is the label above
        out.append(f"data_config:{choices['data']}")
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if "/" in key or key in choices or key.startswith(("hydra", "labels.")) or any(h in key for h in PATH_HINTS):
            continue  # a group choice or a label (tagged above), Hydra's own settings, or a path
        value = OmegaConf.select(cfg, key, default=None) if OmegaConf.is_config(cfg) else None
        out.append(f"{key}:{value}")
    out += [str(t) for t in c.get("tags") or []]
    return list(dict.fromkeys(t[:64] for t in out))  # W&B: at most 64 characters a tag; no duplicates


# ---------------------------------------------------------------- Hydra resolvers

_SWEEP: dict[str, DictConfig] = {}


def study_id() -> str:
    """`<sweep or experiment name>-<hash>` for the multirun being launched: the hash covers the
    command line's identity overrides and the sweeper's parameters, so rerunning the same sweep
    lands in the same folder (and continues its runs) while any other sweep gets its own."""
    cfg = _SWEEP.get("config")
    if cfg is None:
        raise ValueError("multirun/${nl.study:} needs hydra.callbacks.sweep_folder (conf/hydra/default.yaml)")
    hc = cfg.hydra
    choices = hc.runtime.choices
    study = choices.get("sweep") or choices.get("experiment") or "multirun"
    params = hc.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=False) if params is not None else {}
    text = json.dumps({"overrides": _sweep_axes(list(hc.overrides.task)), "params": params}, sort_keys=True,
                      default=str)
    return f"{_safe(str(study))}-{hashlib.sha256(text.encode()).hexdigest()[:6]}"


class SweepFolder:
    """Hydra callback: hands the sweep's own config to `nl.study` before the launcher names the
    sweep folder. Hydra's cache then copies the value into every job's config (also into submitit
    workers), where the job's overrides alone could not reproduce it."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _SWEEP["config"] = config

    def __getattr__(self, name: str):  # Hydra calls the other on_* hooks too: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def _sweep_axes(overrides: list[str]) -> dict[str, list[str]]:
    """{key: sorted values} of the identity overrides: `b=2,1 a=x` and `a=x b=1,2` are one sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    axes = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        bare = key.lstrip("+~")
        if bare.startswith("hydra") or any(bare == k or bare.startswith(k + ".") for k in NOT_IDENTITY):
            continue
        axes[key] = sorted(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
    return axes
