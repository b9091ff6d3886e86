"""run(cfg): validate, build data + model + trainer, fit, score, write results.json.

`train.py` at the project root is the Hydra entry point; this module holds the work so that
tests and other commands can call it with a composed config.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from normlab.checkpoint import write_json
from normlab.checkpoint_io import AtomicCheckpointIO
from normlab.config import validate_run_config
from normlab.callbacks import instantiate_callbacks
from normlab.final_test import final_scores, summary_lines
from normlab.lit_module import Seq2SeqModule
from normlab.loggers import build_loggers, finish_loggers

log = logging.getLogger("normlab")
CHOICE_GROUPS = ("data", "model", "norm", "regularizer", "init", "optim", "trainer", "logger", "experiment",
                 "arm", "sweep")


def hydra_choices() -> dict[str, str | None]:
    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    return {k: choices.get(k) for k in CHOICE_GROUPS if k in choices}


def run_dir_of(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("run_dir") or "outputs/manual")


def describe(cfg: DictConfig, choices: dict) -> tuple[str, str, list[str]]:
    """W&B name, group and tags from the Hydra choices, so the dashboard groups by them."""
    group = cfg.get("group")
    if not group and HydraConfig.initialized():  # a sweep groups by its folder, a run by its experiment
        hc = HydraConfig.get()
        group = Path(hc.sweep.dir).name if hc.mode.name == "MULTIRUN" else hc.runtime.choices.get("experiment")
    group = group or "default"
    m = cfg.model
    tags = [f"{k}:{v}" for k, v in choices.items() if v is not None]
    tags += [f"enc:{m.encoder_layers}", f"dec:{m.decoder_layers}", f"seed:{cfg.seed}", *cfg.get("tags", [])]
    return str(cfg.name), str(group), tags


def run(cfg: DictConfig) -> dict[str, Any]:
    t0 = time.time()
    validate_run_config(cfg)  # fails before any data is read, naming the key
    callbacks = instantiate_callbacks(cfg.get("callbacks"))  # so does a bad callback setting
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    choices = hydra_choices()
    L.seed_everything(cfg.seed, workers=True)

    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("fit")
    tok = dm.tokenizer
    tok.save(run_dir / "tokenizer")
    from normlab.config import model_config_from_hydra

    model_cfg = model_config_from_hydra(cfg, vocab_size=tok.vocab_size,
                                        special={"pad_id": tok.pad_id, "bos_id": tok.bos_id, "eos_id": tok.eos_id})
    module = Seq2SeqModule(model_cfg.to_dict(), optim=OmegaConf.to_container(cfg.optim, resolve=True),
                           eval=OmegaConf.to_container(cfg.eval, resolve=True), tokenizer_proto=tok.proto,
                           compile=cfg.model.get("compile", False))
    name, group, tags = describe(cfg, choices)
    full_cfg = OmegaConf.to_container(cfg, resolve=True)
    loggers = build_loggers(cfg.get("logger"), run_dir, cfg.project, name, group, tags,
                            config=full_cfg | {"choices": choices})
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks,
                                                 plugins=[AtomicCheckpointIO()], default_root_dir=str(run_dir))
    results: dict[str, Any] = {"status": "running", "run_dir": str(run_dir), "choices": choices, "name": name,
                               "group": group, "seed": cfg.seed, "params": module.model.num_parameters()}
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=cfg.get("resume"))
        # Ctrl-C / SIGTERM make Lightning return early with trainer.interrupted set: not a result.
        status = "interrupted" if trainer.interrupted else getattr(module, "status", "completed")
        results.update(status=status, **getattr(module, "divergence", {}), **getattr(module, "stall", {}))
        results.update(final_scores(cfg, trainer, module, dm, run_dir))
    finally:
        results.update(steps=trainer.global_step, train_tokens_per_s=round(module.train_tokens_per_s, 1),
                       wall_s=round(time.time() - t0, 1))
        if module.compile_seconds is not None:  # model.compile=true: first step, compilation included
            results["compile_s"] = round(module.compile_seconds, 1)
        if trainer.is_global_zero:
            write_json(run_dir / "results.json", results)
        finish_loggers(loggers, results)
    if trainer.is_global_zero:
        for line in summary_lines(results):
            log.info(line)
    return results
