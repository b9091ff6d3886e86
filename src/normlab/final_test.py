"""What the final test adds to results.json beside the beam-search test BLEU (train._final_scores).

- test_bleu_greedy: the validation decoder (greedy) on the test set, when the test decoder differs;
- test_bleu_avg / test_chrf_avg: the average of the last `callbacks.step_checkpoints.keep_last_n`
  checkpoints (written every `every_n_steps` steps as step<N>.ckpt), decoded like test_bleu
  (Vaswani et al. 2017 report averaged checkpoints: the last 5 for base models);
- decoders: the decoder settings of valid and test.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from normlab.averaging import average_checkpoints, save_checkpoint, step_checkpoints

log = logging.getLogger("normlab")


def extra_test_scores(cfg: DictConfig, trainer, module, dm, ckpt: str | None, run_dir: Path) -> dict[str, Any]:
    plain = lambda node: OmegaConf.to_container(node, resolve=True) if node is not None else None  # noqa: E731
    valid_dec, test_dec = plain(cfg.eval.decoder), plain(cfg.eval.get("test_decoder")) or plain(cfg.eval.decoder)
    out: dict[str, Any] = {"decoders": {"valid": valid_dec, "test": test_dec}}
    if cfg.eval.get("test_greedy", True) and test_dec != valid_dec:
        beam_decode, module.test_decode = module.test_decode, module.decode
        try:
            trainer.test(module, datamodule=dm, ckpt_path=ckpt, verbose=False)
        finally:
            module.test_decode = beam_decode
        out["test_bleu_greedy"] = module.split_scores.get("test", {}).get("bleu")
    n = int(cfg.callbacks.step_checkpoints.get("keep_last_n") or 0)
    if cfg.eval.get("test_average", True) and n > 0:
        out.update(_averaged_test(trainer, module, dm, run_dir, n))
    return out


def _averaged_test(trainer, module, dm, run_dir: Path, n: int) -> dict[str, Any]:
    paths = step_checkpoints(run_dir)[-n:]
    if len(paths) < 2:
        log.info("test_bleu_avg: %d step checkpoint(s) in %s, need 2 to average", len(paths), run_dir)
        return {"test_bleu_avg": None}
    avg_path = run_dir / "checkpoints" / f"avg-last{len(paths)}.ckpt"
    if trainer.is_global_zero:
        save_checkpoint(average_checkpoints(paths), avg_path)
    trainer.strategy.barrier()
    trainer.test(module, datamodule=dm, ckpt_path=str(avg_path), verbose=False)
    t = module.split_scores.get("test", {})
    return {"test_bleu_avg": t.get("bleu"), "test_chrf_avg": t.get("chrf"),
            "averaged_checkpoints": [p.name for p in paths], "averaged_checkpoint": str(avg_path)}
