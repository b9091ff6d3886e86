"""The pieces of an exact continuation, one at a time: the run folder's decisions (finished, another
run, which checkpoint), the CSV history, the W&B id, fine-tuning weights, resume errors. (The train
loader's position: tests/test_batching.py and test_data_module.py.)"""
import csv
import json

import pytest
import torch

from normlab.checkpoint import CheckpointError

from normlab.config import ConfigError
from normlab.run_folder import RUN_FILE, csv_histories, prepare, restore_csv_histories


def _ckpt(path, step):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {"w": torch.ones(3) * step}}, path)


def test_continuation_skips_an_unreadable_checkpoint_and_removes_temp_files(tmp_path):
    ck = tmp_path / "checkpoints"
    _ckpt(ck / "full-step4.ckpt", 4)
    _ckpt(ck / "full-step8.ckpt", 8)
    data = (ck / "full-step8.ckpt").read_bytes()
    (ck / "full-step8.ckpt").write_bytes(data[: len(data) // 2])  # killed mid-copy, say
    (ck / ".full-step12.ckpt.abc123.tmp").write_bytes(b"")  # an atomic write killed before its rename
    (ck / "full-step12.ckpt").write_bytes(b"")
    cont = prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=False)
    assert (cont.checkpoint, cont.step) == (ck / "full-step4.ckpt", 4)
    assert not list(ck.glob(".*.tmp"))
    assert json.loads((tmp_path / RUN_FILE).read_text())["identity_hash"] == "h1"


def test_finished_other_and_retrained_runs(tmp_path):
    first = prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=False)
    assert first.checkpoint is None and first.finished is None
    assert prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=False).wandb_id == first.wandb_id  # same W&B run
    (tmp_path / "results.json").write_text(json.dumps({"status": "completed", "test_bleu": 1.0}))
    assert prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=False).finished["test_bleu"] == 1.0
    with pytest.raises(ConfigError, match=r"holds another run \(run-h1\), which differs in seed \(1 -> 2\)"):
        prepare(tmp_path, {"seed": 2}, "h2", "run-h2", retrain=False)
    _ckpt(tmp_path / "checkpoints" / "full-step4.ckpt", 4)
    again = prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=True)
    assert again.finished is None and again.checkpoint is None and again.wandb_id != first.wandb_id
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "checkpoints").exists()
    # another rank started beside rank 0 (torchrun, SLURM) may look before rank 0 has wiped: it
    # must start from step 0 too, not from the checkpoint about to be deleted
    _ckpt(tmp_path / "checkpoints" / "full-step4.ckpt", 4)
    other = prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=True, rank_zero=False)
    assert other.checkpoint is None and (tmp_path / "checkpoints" / "full-step4.ckpt").exists()


def test_csv_history_is_cut_at_the_continuation_step_and_extended(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    path = tmp_path / "csv" / "metrics.csv"
    path.parent.mkdir()
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "train/loss"])
        w.writeheader()
        w.writerows({"step": s, "train/loss": 10 - s} for s in range(8))
    histories = csv_histories(tmp_path, 5)
    logger = CSVLogger(save_dir=str(tmp_path), name="csv", version="")
    restore_csv_histories([logger], histories)
    logger.log_metrics({"train/loss": 5.0, "valid/loss": 6.0}, step=5)
    logger.save()
    rows = list(csv.DictReader(open(path)))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[0]["train/loss"] == "10" and rows[-1]["valid/loss"] == "6.0"


def test_a_continued_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from normlab.loggers import build_loggers, finish_loggers

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wandb_id = prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=False).wandb_id
    node = OmegaConf.create({"wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger", "mode": "offline"}})
    for leg in range(2):  # each leg of the run: the id from run.json, resume="allow"
        run_id = prepare(tmp_path, {"seed": 1}, "h1", "run-h1", retrain=False).wandb_id
        (logger,) = build_loggers(node, tmp_path, "normlab-test", "run-h1", "g", [], {}, run_id=run_id)
        logger.log_metrics({"train/loss": 1.0 / (leg + 1)}, step=leg)
        assert logger.experiment.id == wandb_id
        finish_loggers([logger])
    legs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(legs) == 2 and all(wandb_id in p.name for p in legs)  # (a leg in the same second gets a -1 suffix)


def test_finetune_weights_load_into_a_model_without_layerdrop_and_refuse_other_shapes():
    from normlab.config import ModelConfig
    from normlab.model.transformer import Seq2SeqTransformer
    from normlab.start_checkpoint import load_finetune_weights

    base = dict(vocab_size=31, d_model=16, encoder_layers=2, decoder_layers=2, encoder_heads=2, decoder_heads=2,
                encoder_ffn=32, decoder_ffn=32, max_positions=64)
    source = Seq2SeqTransformer(ModelConfig(**base, regularizer={"encoder_layerdrop": 0.2, "decoder_layerdrop": 0.2}))
    ckpt = {"state_dict": {f"model.{k}": v for k, v in source.state_dict().items()}}
    target = Seq2SeqTransformer(ModelConfig(**base))  # LayerDrop off for fine-tuning: no draw counter
    load_finetune_weights(target, ckpt, "x.ckpt")
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in target.state_dict().items())
    with pytest.raises(ConfigError, match="finetune=x.ckpt: the weights do not fit the model"):
        load_finetune_weights(Seq2SeqTransformer(ModelConfig(**{**base, "encoder_ffn": 64})), ckpt, "x.ckpt")


@pytest.mark.integration
def test_an_unreadable_resume_checkpoint_is_one_error_before_any_data(tmp_path):
    from conftest import compose_cfg

    from normlab.train import run

    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"PK\x03\x04 truncated")
    cfg = compose_cfg(["logger=csv", f"resume={bad}", "data.train_src=/nonexistent.de", f"++run_dir={tmp_path / 'r'}"])
    with pytest.raises(CheckpointError, match=r"last.ckpt: not a readable checkpoint, truncated or not a torch file"):
        run(cfg)
    weights = tmp_path / "weights.ckpt"
    torch.save({"model_config": {"d_model": 16}, "state_dict": {}}, weights)
    with pytest.raises(ConfigError, match="holds weights only .* finetune="):
        run(compose_cfg(["logger=csv", f"resume={weights}", f"++run_dir={tmp_path / 'r'}"]))


def test_resume_weights_that_do_not_fit_the_typed_model_are_one_error():
    # a model key typed on the command line wins over the checkpoint's; if it changes a shape, Lightning's
    # strict restore would fail inside fit with a traceback: check_weights_fit says it in one line first
    from normlab.config import ModelConfig
    from normlab.lit_module import Seq2SeqModule
    from normlab.settings import EvalSpec, OptimSpec
    from normlab.start_checkpoint import check_weights_fit

    base = dict(vocab_size=31, d_model=16, encoder_heads=2, decoder_heads=2, encoder_ffn=32, decoder_ffn=32,
                max_positions=64, decoder_layers=1)
    optim = OptimSpec(lr=1e-3, warmup=0, betas=[0.9, 0.98], eps=1e-9, label_smoothing=0.1)
    two, three = (Seq2SeqModule(ModelConfig(**base, encoder_layers=n).to_dict(), optim=optim, eval=EvalSpec())
                  for n in (2, 3))
    check_weights_fit(two, {"state_dict": two.state_dict()}, "a.ckpt")  # fits: no error
    with pytest.raises(ConfigError, match=r"resume=a.ckpt: .*do not fit .*encoder.layers.2.*finetune="):
        check_weights_fit(three, {"state_dict": two.state_dict()}, "a.ckpt")
