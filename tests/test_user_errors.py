"""Bad input gets one line and loses nothing: `error: <key or file:line>: <what> (allowed: ...)`,
exit status 2, no traceback, no run folder left behind; a sweep records the job as failed and
goes on; NORMLAB_TRACEBACK=1 / HYDRA_FULL_ERROR=1 show the traceback."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from normlab.commands.train import main as train_main
from normlab.config import ConfigError

from conftest import ROOT
from normlab.model.norms import NORMS

TYPES = ", ".join(NORMS)  # the allowed lists come from their owners
OPTIONS = ", ".join(sorted(p.stem for p in (ROOT / "conf" / "norm").glob("*.yaml")))


def one_error_line(capsys) -> str:
    """The one line printed, stdout (where the console's log lines go) and stderr together."""
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.out + out.err
    return lines[0]


@pytest.mark.integration
@pytest.mark.parametrize("override, line", [
    # Hydra's own composition errors
    ("norm=foo", f"error: norm=foo: no such norm option (allowed: {OPTIONS})"),
    ("model.dmodel=64", "error: model.dmodel: not a config key (did you mean model.d_model? to add a new key: +model.dmodel=64)"),
    ("model.d_model=[1", "error: no viable alternative at input '[1'; "),
    ("model=tiny,small", "error: Ambiguous value for argument 'model=tiny,small'; "),
    # values checked before any data is read
    ("norm.type=batchnorm", f"error: norm.type: 'batchnorm' is not valid (allowed: {TYPES})"),
    ("data=custom", "error: data.train_src: no value given (the config says ???): set it with data.train_src=...; "),
    ("trainer.val_check_interval=0", "error: trainer.val_check_interval: 0 is not valid (allowed: "),
    ("eval.test_decoder.lenpen=abc", "error: eval.test_decoder.lenpen: 'abc' is not valid (allowed: "),
    ("eval.valid_subset=0", "error: eval.valid_subset: 0 is not valid (allowed: an integer number of valid "
                            "sentences > 0, or null for all)"),
    ("eval.valid_subset=0.5", "error: eval.valid_subset: 0.5 is not valid (allowed: an integer number of valid "),
    ("resume=nowhere.ckpt", "error: nowhere.ckpt: no such checkpoint file"),
    # the attention-stability schemes (issue 38): a value, and a combination
    ("model.attn_gate=channel", "error: model.attn_gate: 'channel' is not valid (allowed: none, headwise, elementwise)"),
    ("model.k_norm=true model.qk_norm=rms", "error: model.k_norm: true with model.qk_norm=rms: QK-norm already "),
    # found by a new user's trial: each used to crash late, leave a folder, or run silently wrong
    ("seed=-1", "error: seed: -1 is not valid (allowed: an integer in [0, 2**32 - 1])"),
    ("retrain=no", "error: retrain: 'no' is not valid (allowed: true, false)"),
    ("retrain=maybe", "error: retrain: 'maybe' is not valid (allowed: true, false)"),
    ("data.num_workers=-1", "error: data.num_workers: -1 is not valid (allowed: an integer >= 0)"),
    ("data.spm_model_type=foo", "error: data.spm_model_type: 'foo' is not valid (allowed: bpe, unigram, char, word)"),
    ("callbacks.checkpoint.monitor=valid/blue", "error: callbacks.checkpoint.monitor: 'valid/blue' is not valid"),
    ("+trainer.limit_train_batches=0", "error: trainer.limit_train_batches: 0 trains no batch"),
    ("regularizer=layerdrop regularizer.encoder_layerdrop=1.0",
     "error: regularizer.encoder_layerdrop: 1.0 drops every layer at every step: nothing would train"),
    ("trainer.max_time=abc", "error: trainer.max_time: 'abc' is not valid (allowed: null, DD:HH:MM:SS"),
    ("trainer.accelerator=gpu", "error: trainer.accelerator: 'gpu': this machine has no CUDA GPU"),
    ("trainer.num_nodes=0", "error: trainer.num_nodes: 0 is not valid (allowed: an integer > 0)"),
    # the callbacks built with the run's outcome (normlab/outcome.py): their constructors' errors too
    ("callbacks.divergence.factor=0.5", "error: callbacks.divergence.factor: 0.5 is not valid (allowed: a number > 1"),
    ("+callbacks.stall.bogus=1", "error: callbacks.stall.bogus: not an option of this callback (allowed: window, "),
    ("callbacks.preemption.signals=[SIGFOO]", "error: callbacks.preemption.signals: 'SIGFOO' is not valid"),
])
def test_bad_override_is_one_line_exit_2_and_no_folder(override, line, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("NORMLAB_TRACEBACK", raising=False)
    assert train_main([*override.split(), "logger=csv"]) == 2
    assert one_error_line(capsys).startswith(line)
    assert list(tmp_path.iterdir()) == []  # Hydra's outputs/<date>/<time>_<name> removed, with its parents


@pytest.mark.integration
def test_a_folder_with_work_is_never_removed(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"work")
    monkeypatch.chdir(tmp_path)
    assert train_main(["norm.type=batchnorm", f"hydra.run.dir={run_dir}"]) == 2
    one_error_line(capsys)
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() == b"work"
    assert json.loads((run_dir / "results.json").read_text())["status"] == "failed"


@pytest.mark.integration
@pytest.mark.parametrize("env", ["NORMLAB_TRACEBACK", "HYDRA_FULL_ERROR"])
def test_traceback_on_request(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(env, "1")
    with pytest.raises(ConfigError, match="norm.type"):
        train_main(["norm.type=batchnorm"])


@pytest.mark.integration
def test_sweep_records_bad_jobs_as_failed_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    assert train_main(["-m", "norm.type=batchnorm,groupnorm", "logger=csv", f"hydra.sweep.dir={sweep}",
                       "hydra.sweep.subdir=${hydra.job.num}"]) == 0
    results = {d.name: json.loads((d / "results.json").read_text()) for d in sweep.iterdir() if d.is_dir()}
    assert sorted(results) == ["0", "1"]  # the second job ran after the first failed
    assert [results[k]["error"] for k in ("0", "1")] == [
        f"ConfigError: norm.type: 'batchnorm' is not valid (allowed: {TYPES})",
        f"ConfigError: norm.type: 'groupnorm' is not valid (allowed: {TYPES})"]


@pytest.mark.integration
def test_train_py_as_a_user_runs_it(tmp_path):
    """What the before-stop hook checks: `python train.py norm.type=batchnorm` in a fresh folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "NORMLAB_TRACEBACK")}
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "norm.type=batchnorm"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr == f"error: norm.type: 'batchnorm' is not valid (allowed: {TYPES})\n"
    assert p.stdout == "" and list(tmp_path.iterdir()) == []


def test_a_bad_command_flag_is_one_line_too(capsys):
    from normlab.commands import translate
    from normlab.commands.common import main_guard

    assert main_guard(translate.main, ["run", "--beam", "four"]) == 2
    assert one_error_line(capsys) == ("error: python -m normlab.commands.translate: argument --beam: invalid int value: "
                                      "'four' (see python -m normlab.commands.translate --help)")


@pytest.fixture(scope="module")
def tiny_checkpoint(small_corpus, tmp_path_factory):
    from normlab.train import run

    from conftest import compose_cfg, tiny_overrides

    tmp = tmp_path_factory.mktemp("start")
    results = run(compose_cfg(tiny_overrides(small_corpus, tmp / "run", tmp / "cache") + ["trainer.max_steps=2"]))
    assert results["status"] == "completed"
    return tmp / "run" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("start, override, says", [
    # a typed model key that does not combine with the checkpoint's model
    ("resume", "model.d_model=48", "model.d_model=48 do not combine: model.share_embeddings: true needs"),
    # a typed model key that changes a weight's shape
    ("finetune", "model.encoder_ffn=40", "the weights do not fit the model"),
    ("resume", "model.encoder_ffn=40", "the checkpoint's weights do not fit the model the command line builds"),
])
def test_a_checkpoint_that_does_not_fit_is_one_line_naming_it_and_no_folder(
        start, override, says, tiny_checkpoint, small_corpus, tmp_path, monkeypatch, capsys):
    from conftest import tiny_overrides

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NORMLAB_TRACEBACK", raising=False)
    args = [a for a in tiny_overrides(small_corpus, tmp_path / "new", tmp_path / "cache")
            if not a.startswith(("++run_dir", "model."))]  # the model is the checkpoint's
    assert train_main([*args, f"{start}={tiny_checkpoint}", override, f"hydra.run.dir={tmp_path / 'new'}"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {start}={tiny_checkpoint}: ") and says in line, line
    assert not (tmp_path / "new").exists()


def test_resume_past_max_steps_is_one_line_and_no_folder(tiny_checkpoint, small_corpus, tmp_path, monkeypatch, capsys):
    """resume= a checkpoint at step 2 with trainer.max_steps=2: nothing to train (it used to train 0
    steps and then fail looking for a best checkpoint of the other run)."""
    from conftest import tiny_overrides

    monkeypatch.chdir(tmp_path)
    args = [a for a in tiny_overrides(small_corpus, tmp_path / "new", tmp_path / "cache")
            if not a.startswith(("++run_dir", "model.", "trainer.max_steps"))]
    assert train_main([*args, f"resume={tiny_checkpoint}", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'new'}"]) == 2
    assert one_error_line(capsys) == (f"error: resume={tiny_checkpoint}: the checkpoint is at step 2: trainer.max_steps=2 "
                                      "leaves nothing to train (set it above 2, or use finetune= to start the step count afresh)")
    assert not (tmp_path / "new").exists()


@pytest.mark.integration
def test_a_rejected_corpus_leaves_nothing_in_the_cache(small_corpus, tmp_path, monkeypatch, capsys):
    """The cache entry's lock file goes with its holder: a corpus refused while it is built leaves no
    `.<entry>.lock` (nor a folder) in the cache, and a built entry leaves only its folder."""
    import shutil

    from conftest import tiny_overrides

    monkeypatch.chdir(tmp_path)
    bad = {k: str(tmp_path / Path(v).name) for k, v in small_corpus.items()}
    for k, v in small_corpus.items():
        shutil.copy(v, bad[k])
    lines = Path(bad["train_tgt"]).read_bytes().splitlines()
    Path(bad["train_tgt"]).write_bytes(b"\n".join(lines[:-1] + [b"caf\xe9"]) + b"\n")  # not UTF-8, last line
    cache = tmp_path / "cache"
    args = [a for a in tiny_overrides(bad, tmp_path / "r", cache) if not a.startswith("++run_dir")]
    assert train_main([*args, f"hydra.run.dir={tmp_path / 'r'}"]) == 2
    assert one_error_line(capsys).startswith(f"error: {bad['train_tgt']}:{len(lines)}: ")
    assert [p.name for p in (cache / "data").iterdir()] == []
    good = [a for a in tiny_overrides(small_corpus, tmp_path / "g", cache) if not a.startswith("++run_dir")]
    assert train_main([*good, f"hydra.run.dir={tmp_path / 'g'}", "trainer.max_steps=1", "eval.test=false"]) == 0
    assert not [p.name for p in (cache / "data").iterdir() if p.name.endswith(".lock")]


def test_a_start_checkpoint_failing_two_checks_is_refused_by_the_first(tiny_checkpoint, small_corpus, tmp_path):
    """resume= / finetune= checks run in one order (run_identity.identify's docstring,
    docs/runs-that-survive.md): the command line alone, the file (found, readable, full state for
    resume=), the model it builds with the checkpoint's, then the checkpoint against the run
    (tokenizer, optimizer, trainer.max_steps). Each case fails two checks; the earlier one is the line."""
    import torch

    from conftest import refused, tiny_overrides

    args = [a for a in tiny_overrides(small_corpus, tmp_path / "new", tmp_path / "cache")
            if not a.startswith(("++run_dir", "model.", "trainer.max_steps"))] + [f"hydra.run.dir={tmp_path / 'new'}"]
    missing = tmp_path / "absent.ckpt"
    weights = tmp_path / "weights.ckpt"  # the checkpoint at step 2 without its optimizer state and loops
    torch.save({k: v for k, v in torch.load(tiny_checkpoint, weights_only=False).items()
                if k not in ("optimizer_states", "loops")}, weights)
    # the command line's own error before a file that does not exist
    assert refused([*args, f"resume={missing}", "trainer.max_steps=0"], tmp_path, here=True).startswith(
        "error: trainer.max_steps: ")
    # weights only (resume= needs the full state) before trainer.max_steps=2 leaving nothing to train
    line = refused([*args, f"resume={weights}", "trainer.max_steps=2"], tmp_path, here=True)
    assert line.startswith(f"error: resume={weights}: ") and "holds weights only" in line, line
    # a typed model key that does not combine with the checkpoint's model, before trainer.max_steps=2
    line = refused([*args, f"resume={tiny_checkpoint}", "trainer.max_steps=2", "model.d_model=48"], tmp_path, here=True)
    assert line.startswith(f"error: resume={tiny_checkpoint}: ") and "model.d_model=48 do not combine" in line, line
    # the optimizer the checkpoint trained with, before trainer.max_steps=2
    line = refused([*args, f"resume={tiny_checkpoint}", "trainer.max_steps=2", "optim.optimizer=adamw"], tmp_path, here=True)
    assert line.startswith("error: optim.optimizer: 'adamw': ") and "trained with 'adam'" in line, line
    assert not (tmp_path / "new").exists()
