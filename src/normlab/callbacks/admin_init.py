"""Admin initialisation as a Lightning callback: ω is set once, before optimizer step 1.

Configured by `init=admin`: conf/init/admin.yaml holds the settings (`init.admin.mode=profile|
closed_form`, `init.admin.batches`) and adds this callback's node (conf/callbacks/admin_init.yaml)
to `callbacks`, whose nodes train.py instantiates. Runs at `on_fit_start` — after the strategy has set up (DDP wrapping,
process group) and before the first batch — and is skipped when the run resumes from a
checkpoint (ω then comes from the checkpoint: it is a parameter). Under DDP only rank 0 profiles
(on its shard of the first batches) and broadcasts ω, so all ranks start identical.
The values are written to `<run dir>/admin_omega.json`.
"""
from __future__ import annotations

import itertools
import logging
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from normlab.checkpoint import write_json
from normlab.config import ConfigError
from normlab.init.admin import CONVENTIONS, MODES, closed_form_omega_, omega_values, profile_omega_

log = logging.getLogger("normlab")


def broadcast_omega_(model: torch.nn.Module, src: int = 0) -> None:
    """Copy every ω from rank `src` to all ranks (one flat tensor, one collective)."""
    omegas = [block.omega for _, block in model.residual_blocks()]
    flat = torch.cat([w.detach().reshape(-1) for w in omegas])
    dist.broadcast(flat, src=src)
    with torch.no_grad():
        for w, part in zip(omegas, torch.split(flat, [w.numel() for w in omegas])):
            w.copy_(part.view_as(w))


class AdminInit(L.Callback):
    def __init__(self, mode: str = "profile", batches: int = 4, convention: str = "paper"):
        if mode not in MODES:
            raise ConfigError("init.admin.mode", f"{mode!r} is not valid", MODES)
        if convention not in CONVENTIONS:
            raise ConfigError("init.admin.convention", f"{convention!r} is not valid", CONVENTIONS)
        if not isinstance(batches, int) or batches < 1:
            raise ConfigError("init.admin.batches", f"{batches!r} is not valid", "an integer > 0")
        self.mode, self.batches, self.convention = mode, batches, convention
        self.report: dict | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path:  # resuming: ω was restored with the other parameters
            return
        model = pl_module.model
        if trainer.is_global_zero:
            if self.mode == "profile":
                loader = trainer.datamodule.train_dataloader()
                batches = list(itertools.islice(iter(loader), self.batches))
                self.report = profile_omega_(model, batches, pl_module.model_cfg.pad_id, self.convention)
            else:
                self.report = closed_form_omega_(model)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            broadcast_omega_(model)
        if trainer.is_global_zero:
            out = Path(trainer.default_root_dir) / "admin_omega.json"
            write_json(out, {"mode": self.mode, "batches": self.batches if self.mode == "profile" else 0,
                             "convention": self.convention if self.mode == "profile" else None,
                             "per_stack": self.report,
                             "omega": {k: v[0] for k, v in omega_values(model).items()}})
            log.info("Admin ω (%s) written to %s", self.mode, out)
