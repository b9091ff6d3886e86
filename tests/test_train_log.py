"""The fairseq-like text line: every log_every_n_steps in the console and train.log, bar on or off,
with values equal to what the loggers record; no duplicated Lightning lines, no `None` scores."""
import csv
import re

import pytest

from normlab.commands.train import main as train_main

from conftest import tiny_overrides

LINE = re.compile(r"step (\d+)/(\d+) \| epoch (\d+) \| loss ([\d.]+) \| nll ([\d.]+) \| ppl ([\d.]+) \| "
                  r"lr ([\d.e+-]+) \| gnorm ([\d.]+) \| tgt tok/s ([\d,]+) \| upd/s ([\d.]+) \| "
                  r"elapsed (\d+:\d\d:\d\d) \| eta (\d+:\d\d:\d\d)$")


def tiny_run(small_corpus, tmp_path, monkeypatch, *extra: str) -> tuple[str, str]:
    monkeypatch.chdir(tmp_path)
    over = [o for o in tiny_overrides(small_corpus, tmp_path / "x", tmp_path / "cache") if not o.startswith("+run_dir")]
    assert train_main([*over, f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=4",
                       "trainer.val_check_interval=4", "callbacks.step_checkpoints.keep_last_n=0", *extra]) == 0
    return (tmp_path / "run" / "train.log").read_text()


@pytest.mark.integration
def test_a_line_per_step_with_the_logged_values(small_corpus, tmp_path, monkeypatch, capsys):
    text = tiny_run(small_corpus, tmp_path, monkeypatch, "trainer.log_every_n_steps=1", "eval.test=false")
    out = capsys.readouterr().out
    lines = [m for m in map(LINE.search, text.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == [1, 2, 3, 4] and {m.group(2) for m in lines} == {"4"}
    assert sum(bool(LINE.search(line)) for line in out.splitlines()) == 4  # the console has them too
    # with a line per step, each line's loss / nll / lr are that step's, as the CSV logger recorded them
    rows = {int(r["step"]): r for r in csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open())
            if r.get("train/loss")}
    for m in lines:
        row = rows[int(m.group(1)) - 1]  # Lightning logs a step's metrics under the step before it
        assert float(m.group(4)) == pytest.approx(float(row["train/loss"]), abs=6e-4)
        assert float(m.group(5)) == pytest.approx(float(row["train/nll"]), abs=6e-4)
        assert float(m.group(7)) == pytest.approx(float(row["train/lr"]), rel=6e-3)
    # one line per record, no None for a run without a test, no third-party notices
    for noise in ("None", "💡 Tip", "LeafSpec", "Traceback", "INFO: ", "Seed set to"):
        assert noise not in out, noise
    assert out.count("GPU available") <= 1 and "test:" not in out and "valid: BLEU" in out


@pytest.mark.integration
def test_lines_with_the_bar_on(small_corpus, tmp_path, monkeypatch, capsys):
    text = tiny_run(small_corpus, tmp_path, monkeypatch, "trainer.log_every_n_steps=2", "eval.test=false",
                    "trainer.enable_progress_bar=true", "callbacks.progress_bar.tty_only=false")
    assert [int(m.group(1)) for m in map(LINE.search, text.splitlines()) if m] == [2, 4]
    out = capsys.readouterr().out
    console = re.split(r"[\r\n]", out)
    assert sum(bool(LINE.search(line)) for line in console) == 2  # written above the bar, not into it
    assert "tok/s=" in out and "lr=" in out and "Epoch 0/-2" not in out


@pytest.mark.integration
def test_the_console_has_nothing_a_user_cannot_act_on(small_corpus, tmp_path, monkeypatch, capsys):
    """No GPU/TPU lines on CPU, no Lightning `weights_only` warning after a full checkpoint, and the
    checkpoint each final pass loads named once, in normlab's own line (was: Lightning's
    "Loaded model weights from the checkpoint at ..." once per pass)."""
    text = tiny_run(small_corpus, tmp_path, monkeypatch, "callbacks.full_checkpoint.every_n_steps=2",
                    "eval.test_decoder.max_len_b=5", "eval.decoder.max_len_b=5")
    captured = capsys.readouterr()
    out = captured.out + captured.err
    for noise in ("GPU available: False", "TPU available: False", "weights_only", "Loaded model weights",
                  "`Trainer.fit` stopped"):
        assert noise not in out and noise not in text, noise
    assert re.search(r"final test \(best-step4\.ckpt\)", out)


@pytest.mark.integration
def test_console_lines_carry_the_time_only_and_the_text_log_the_full_prefix(small_corpus, tmp_path, monkeypatch,
                                                                            capsys):
    """Console: `[HH:MM:SS] message` (was Hydra's ~45-character `[date time,ms][logger][LEVEL] - `);
    a warning says so; <run>/train.log keeps the full prefix."""
    import logging

    text = tiny_run(small_corpus, tmp_path, monkeypatch, "eval.test=false")
    out = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    logged = [line for line in out if re.match(r"\[\d\d:\d\d:\d\d\] \S", line)]
    assert len(logged) >= 5 and not any("][normlab][INFO]" in line for line in out)
    assert any(re.match(r"\[\d\d:\d\d:\d\d\] valid: BLEU", line) for line in logged)
    assert all(re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[[\w.]+\]\[\w+\] - ", line)
               for line in text.splitlines() if line.startswith("[20"))
    assert "][normlab][INFO] - valid: BLEU" in text
    from normlab.log_format import ConsoleFormatter

    record = logging.LogRecord("normlab", logging.WARNING, __file__, 1, "no GPU here", None, None)
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] warning: no GPU here", ConsoleFormatter().format(record))


def test_corpus_statistics_are_one_readable_line():
    from normlab.data.datamodule import stats_line

    st = {"train": {"pairs": 28798, "dropped": {"empty": 0}, "tokens": {"src": 929720, "tgt": 922021},
                    "dropped_long": 3},
          "test": {"pairs": 1000, "dropped": {"empty": 2}, "tokens": {"src": 32961, "tgt": 32639},
                   "truncated_src": 1, "truncated_tgt": 0}}
    assert stats_line("bible_de_en", st) == ("bible_de_en: train 28,798 pairs (929,720 + 922,021 tokens), dropped 3 "
                                             "long; test 1,000 pairs (32,961 + 32,639 tokens), dropped 2 empty, "
                                             "1 sources / 0 targets cut")


def test_lightning_notices_a_user_cannot_act_on_are_filtered():
    import warnings

    from normlab.callbacks.progress import console_setup

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console_setup()
        warnings.warn("The dirpath has changed from '/a/checkpoints' to '/b/checkpoints', therefore ...")
        warnings.warn("something a user can act on")
    assert [str(w.message) for w in seen] == ["something a user can act on"]


@pytest.mark.integration
def test_a_validation_says_when_it_starts_and_how_long_it_took(small_corpus, tmp_path, monkeypatch, capsys):
    """A validation in training (minutes on a study's model) writes a line when it starts, with its
    batches, and its score line ends with its time (a clock that moves 7 s per reading: 7 s)."""
    import itertools
    import time
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from normlab import lit_module
    from normlab.data.datamodule import TranslationDataModule
    from normlab.data.tokenizer import Tokenizer

    from conftest import compose_cfg

    ticks = itertools.count(100, 7)
    monkeypatch.setattr(lit_module, "time", SimpleNamespace(perf_counter=time.perf_counter,
                                                            monotonic=lambda: float(next(ticks))))
    text = tiny_run(small_corpus, tmp_path, monkeypatch, "eval.test=false")
    cfg = compose_cfg(tiny_overrides(small_corpus, tmp_path / "x", tmp_path / "cache"))
    data = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "_target_"}
    batches = len(TranslationDataModule(**data, tokenizer=Tokenizer.load(tmp_path / "run" / "tokenizer"))
                  .dataloader("valid"))
    messages = [line.split(" - ", 1)[1] for line in text.splitlines() if " - " in line]
    lines = [m for m in messages if m.startswith("step ") and " valid: " in m]
    assert lines[0] == f"step 4 valid: started ({batches} batches)"
    assert re.fullmatch(r"step 4 valid: loss [\d.]+  ppl [\d.]+  bleu [\d.]+  chrf [\d.]+  \(7 s\)", lines[1]), lines
    assert len(lines) == 2 and f"step 4 valid: started ({batches} batches)" in capsys.readouterr().out
