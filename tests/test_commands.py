"""translate / evaluate / average on a trained tiny run, and what the final test reports."""
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from normlab.averaging import CheckpointMismatch, average_checkpoints, step_checkpoints
from normlab.checkpoint import load_checkpoint, load_model
from normlab.commands import average, evaluate, preprocess, prune, translate
from normlab.commands.common import main_guard
from normlab.evaluation import score
from normlab.train import run

from conftest import compose_cfg, tiny_overrides

# The run's test decoder; every command below is called with the same settings.
DECODE = ["--beam", "4", "--lenpen", "0.6", "--max-len-b", "20", "--quiet"]
SACREBLEU = Path(sys.executable).parent / "sacrebleu"


def preprocess_corpus(corpus: dict[str, str], out: Path, vocab_size: int = 300) -> Path:
    args = [a for s in ("train", "valid", "test") for a in (f"--{s}", corpus[f"{s}_src"], corpus[f"{s}_tgt"])]
    assert preprocess.main([*args, "--vocab-size", str(vocab_size), "--out", str(out), "--workers", "1", "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory):
    """A tiny run on a folder written by the preprocess command (data=preprocessed), so every
    command below reads its splits from the memory-mapped arrays."""
    run_dir = tmp_path_factory.mktemp("cmdrun")
    folder = preprocess_corpus(small_corpus, run_dir.parent / "cmd-bin")
    overrides = [o for o in tiny_overrides(small_corpus, run_dir, run_dir.parent / "cache") if not o.startswith("data.")]
    cfg = compose_cfg(overrides + [
        "data=preprocessed", f"data.path={folder}", "data.max_tokens=512",
        "callbacks.step_checkpoints.every_n_steps=2", "callbacks.step_checkpoints.keep_last_n=3",
        "eval.test_decoder.max_len_b=20"])
    results = run(cfg)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")  # what @hydra.main leaves in a run folder
    return run_dir, results, small_corpus


def call(main, *args) -> int:
    return main_guard(main, [str(a) for a in args])


def test_results_report_beam_greedy_and_averaged_bleu(trained):
    run_dir, results, _ = trained
    saved = json.loads((run_dir / "results.json").read_text())
    for key in ("test_bleu", "test_bleu_greedy", "test_bleu_avg", "test_chrf_avg"):
        assert isinstance(saved[key], (int, float)), key
    assert saved["decoders"]["test"]["beam"] == 4 and saved["decoders"]["valid"]["beam"] == 1
    assert saved["averaged_checkpoints"] == ["step4.ckpt", "step6.ckpt", "step8.ckpt"]
    assert [p.name for p in step_checkpoints(run_dir)] == saved["averaged_checkpoints"]  # keep_last_n=3
    assert load_model(saved["averaged_checkpoint"])[0].cfg == load_model(run_dir)[0].cfg


def test_evaluate_split_reproduces_the_training_scores(trained, tmp_path):
    run_dir, results, _ = trained
    out = tmp_path / "test.json"
    assert call(evaluate.main, run_dir, "--split", "test", "--output", out, *DECODE) == 0
    got = json.loads(out.read_text())
    assert (got["bleu"], got["chrf"], got["bleu_signature"]) == (
        results["test_bleu"], results["test_chrf"], results["bleu_signature"])
    assert Path(got["hypotheses_file"]).read_text() == (run_dir / "test.hyp").read_text()
    avg = run_dir / "checkpoints" / "avg-last3.ckpt"
    assert call(evaluate.main, avg, "--split", "test", "--output", tmp_path / "avg.json", *DECODE) == 0
    assert json.loads((tmp_path / "avg.json").read_text())["bleu"] == results["test_bleu_avg"]
    # the validation decoder is greedy: --beam 1 reproduces test_bleu_greedy
    assert call(evaluate.main, run_dir, "--split", "test", "--output", tmp_path / "g.json", "--beam", "1", "-q") == 0
    assert json.loads((tmp_path / "g.json").read_text())["bleu"] == results["test_bleu_greedy"]


def test_prune_reads_the_preprocessed_splits(trained, tmp_path):
    run_dir, results, _ = trained
    assert call(prune.main, run_dir, "--strategies", "every_other", "--depths", "1", "--beam", "1",
                "--max-sentences", "10", "--out", tmp_path / "p", "-q") == 0
    got = json.loads((tmp_path / "p" / "prune.json").read_text())
    assert got["sentences"] == {"valid": 10, "test": 10}
    assert [(r["strategy"], r["kept"]) for r in got["rows"]] == [("full", 2), ("every_other", 1)]
    assert all(isinstance(r[k], float) for r in got["rows"] for k in ("valid_bleu", "test_bleu", "test_nll"))


def test_split_commands_refuse_data_encoded_with_another_tokenizer(trained, tmp_path, capsys):
    run_dir, _, corpus = trained
    other = preprocess_corpus(corpus, tmp_path / "other-bin", vocab_size=280)
    fake = tmp_path / "run"
    (fake / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "checkpoints" / "last.ckpt", fake / "checkpoints" / "last.ckpt")
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    cfg.data.path = str(other)
    (fake / ".hydra").mkdir()
    OmegaConf.save(cfg, fake / ".hydra" / "config.yaml")
    capsys.readouterr()
    for main, args in ((evaluate.main, ["--split", "test"]), (prune.main, ["--depths", "1"])):
        assert call(main, fake / "checkpoints" / "last.ckpt", *args, "--beam", "1", "-q") == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {other / 'spm.model'}: differs from the tokenizer of "
                              f"{fake / 'checkpoints' / 'last.ckpt'}") and err.count("\n") == 1, err


def test_evaluate_refuses_to_overwrite(trained, tmp_path, capsys):
    run_dir, _, corpus = trained
    args = ["--src", corpus["test_src"], "--ref", corpus["test_tgt"], "--output", tmp_path / "s.json", *DECODE]
    assert call(evaluate.main, run_dir, *args) == 0
    before = (tmp_path / "s.json").stat().st_mtime_ns
    assert call(evaluate.main, run_dir, *args) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert (tmp_path / "s.json").stat().st_mtime_ns == before
    assert call(evaluate.main, run_dir, *args, "--force") == 0
    assert call(evaluate.main, run_dir, "--split", "test", "--src", corpus["test_src"]) == 2


def sacrebleu_cli(ref: Path, hyp: Path, metric: str) -> float:
    # -w 2: the CLI prints one decimal by default; normlab rounds to two
    out = subprocess.run([str(SACREBLEU), str(ref), "-i", str(hyp), "-m", metric, "-b", "-w", "2"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.strip())


def test_evaluate_bleu_equals_sacrebleu_cli(trained, tmp_path):
    run_dir, _, corpus = trained
    out = tmp_path / "scores.json"
    assert call(evaluate.main, run_dir, "--src", corpus["test_src"], "--ref", corpus["test_tgt"],
                "--output", out, *DECODE) == 0
    got = json.loads(out.read_text())
    hyp = Path(got["hypotheses_file"])
    assert got["bleu"] == sacrebleu_cli(Path(corpus["test_tgt"]), hyp, "bleu")
    assert got["chrf"] == sacrebleu_cli(Path(corpus["test_tgt"]), hyp, "chrf")
    # The tiny model's BLEU is near 0; the scorer must also agree where BLEU is mid-range.
    refs = Path(corpus["test_tgt"]).read_text().splitlines()
    partial = [" ".join(w for i, w in enumerate(r.split()) if i % 3 != 1) for r in refs]
    (tmp_path / "partial.hyp").write_text("\n".join(partial) + "\n")
    s = score(partial, refs)
    assert 10 < s["bleu"] < 90
    assert s["bleu"] == sacrebleu_cli(Path(corpus["test_tgt"]), tmp_path / "partial.hyp", "bleu")
    assert s["chrf"] == sacrebleu_cli(Path(corpus["test_tgt"]), tmp_path / "partial.hyp", "chrf")


def test_translate_round_trip(trained, tmp_path, monkeypatch, capsys):
    run_dir, _, corpus = trained
    src = Path(corpus["test_src"])
    n = len(src.read_text().splitlines())
    out = tmp_path / "out.en"
    assert call(translate.main, run_dir, "--input", src, "--output", out, "--max-tokens", 1024, *DECODE) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == n and sum(bool(x.strip()) for x in lines) > n // 2
    # the same text and batches through evaluate give the same translations
    assert call(evaluate.main, run_dir, "--src", src, "--ref", corpus["test_tgt"], "--output", tmp_path / "e.json",
                "--max-tokens", 1024, *DECODE) == 0
    assert (tmp_path / "e.hyp").read_text() == out.read_text()
    # stdin -> stdout
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(src.read_bytes()), encoding="utf-8"))
    assert call(translate.main, run_dir, "--max-tokens", 1024, *DECODE) == 0
    assert capsys.readouterr().out == out.read_text()
    # n-best: index, score, text; sorted; the first is the 1-best
    nb = tmp_path / "nbest.en"
    assert call(translate.main, run_dir, "--input", src, "--output", nb, "--nbest", 3, "--max-tokens", 1024, *DECODE) == 0
    rows = [r.split("\t") for r in nb.read_text().splitlines()]
    assert len(rows) == 3 * n and [int(r[0]) for r in rows] == [i for i in range(n) for _ in range(3)]
    for i in range(n):
        scores = [float(r[1]) for r in rows[3 * i: 3 * i + 3]]
        assert scores == sorted(scores, reverse=True)
        assert rows[3 * i][2] == lines[i]
    # never overwrites without --force
    assert call(translate.main, run_dir, "--input", src, "--output", out, *DECODE) == 2
    assert "--force" in capsys.readouterr().err


def test_average_command_on_a_run(trained, tmp_path, capsys):
    run_dir, _, corpus = trained
    out = tmp_path / "avg.ckpt"
    assert call(average.main, run_dir, "--last", 2, "--output", out) == 0
    steps = step_checkpoints(run_dir)[-2:]
    states = [load_checkpoint(p)["state_dict"] for p in steps]
    got = load_checkpoint(out)
    assert got["averaged_from"] == [str(p) for p in steps]
    for k, v in got["state_dict"].items():
        torch.testing.assert_close(v, (states[0][k].double() + states[1][k].double()).div(2).float())
    assert "optimizer_states" not in got
    model, tok = load_model(out)
    assert tok is not None and not model.training
    assert call(evaluate.main, out, "--src", corpus["test_src"], "--ref", corpus["test_tgt"],
                "--output", tmp_path / "avg.json", *DECODE) == 0
    # the same average again (as docs/decoding.md's `average $RUN --last 5` after training wrote it): left as it is
    capsys.readouterr()
    assert call(average.main, run_dir, "--last", 2, "--output", out) == 0
    assert "already the average" in capsys.readouterr().out
    # another average into an existing file: refused without --force
    assert call(average.main, steps[-1], steps[-1], "--output", out) == 2
    assert "exists" in capsys.readouterr().err
    # two identical checkpoints average to the same weights
    same = tmp_path / "same.ckpt"
    assert call(average.main, steps[-1], steps[-1], "--output", same) == 0
    ref = load_checkpoint(steps[-1])["state_dict"]
    avg = load_checkpoint(same)["state_dict"]
    assert ref.keys() == avg.keys() and all(torch.equal(ref[k], avg[k]) for k in ref)


def fake_ckpt(path: Path, tensors: dict, d_model: int = 8, proto: bytes = b"spm") -> Path:
    torch.save({"model_config": {"d_model": d_model, "norm": {"type": "layernorm"}},
                "state_dict": tensors, "tokenizer_proto": proto, "optimizer_states": [{}]}, path)
    return path


def test_average_of_known_tensors_is_their_mean(tmp_path):
    values = [([1.0, 2.0], [[0.5]]), ([3.0, 4.0], [[1.5]]), ([5.0, 9.0], [[4.0]])]
    paths = [fake_ckpt(tmp_path / f"step{i}.ckpt", {"model.w": torch.tensor(w), "model.h": torch.tensor(h).half(),
                                                     "model.count": torch.tensor(7)})
             for i, (w, h) in enumerate(values)]
    avg = average_checkpoints(paths)
    assert torch.equal(avg["state_dict"]["model.w"], torch.tensor([3.0, 5.0]))
    assert avg["state_dict"]["model.h"].dtype == torch.float16
    assert torch.equal(avg["state_dict"]["model.h"], torch.tensor([[2.0]]).half())
    assert torch.equal(avg["state_dict"]["model.count"], torch.tensor(7))
    assert "optimizer_states" not in avg and avg["tokenizer_proto"] == b"spm"


def test_average_takes_the_last_layerdrop_draw_counter_and_refuses_other_integers_that_differ(tmp_path):
    """A LayerDrop run's step checkpoints differ in its draw counter (regularizers/layerdrop.py): the
    average takes the last's, as it takes the last's training state; other integers must agree."""
    paths = [fake_ckpt(tmp_path / f"step{i}.ckpt", {"model.w": torch.tensor([float(i)]),
                                                     "model.encoder.layers.draw_state": torch.tensor([5, 10 * i])})
             for i in range(3)]
    avg = average_checkpoints(paths)
    assert torch.equal(avg["state_dict"]["model.encoder.layers.draw_state"], torch.tensor([5, 20]))
    assert torch.equal(avg["state_dict"]["model.w"], torch.tensor([1.0]))
    other = fake_ckpt(tmp_path / "other.ckpt", {"model.w": torch.tensor([0.0]),
                                                 "model.encoder.layers.draw_state": torch.tensor([5, 0]),
                                                 "model.count": torch.tensor(8)})
    base = fake_ckpt(tmp_path / "base.ckpt", {"model.w": torch.tensor([0.0]),
                                               "model.encoder.layers.draw_state": torch.tensor([5, 0]),
                                               "model.count": torch.tensor(7)})
    with pytest.raises(CheckpointMismatch, match="integer tensor model.count differs"):
        average_checkpoints([base, other])
    seed = fake_ckpt(tmp_path / "seed.ckpt", {"model.w": torch.tensor([0.0]),  # another seed: another run
                                               "model.encoder.layers.draw_state": torch.tensor([6, 0]),
                                               "model.count": torch.tensor(7)})
    with pytest.raises(CheckpointMismatch, match="integer tensor model.encoder.layers.draw_state differs"):
        average_checkpoints([base, seed])


@pytest.mark.integration
def test_a_layerdrop_run_scores_its_averaged_checkpoints(small_corpus, tmp_path):
    """The default final passes on a LayerDrop run: the averaged test pass runs (it failed with
    "the run's step checkpoints do not average" when the draw counter had to be equal), and its
    scores equal the run's step checkpoints averaged here, scored by test_final_test's independent
    computation with the test decoder (one process, the same sums in the same order: exactly). BLEU
    is 0 after 4 steps; the loss, ppl and chrF tell the averaged weights from the last step's."""
    from test_final_test import independent_scores

    run_dir = tmp_path / "run"
    cfg = compose_cfg(tiny_overrides(small_corpus, run_dir, tmp_path / "cache") + [
        "regularizer=layerdrop", "model.encoder_layers=2", "model.decoder_layers=2", "trainer.max_steps=4",
        "callbacks.step_checkpoints.every_n_steps=2", "eval.test=true", "eval.test_average=true",
        "eval.test_decoder.max_len_b=5", "eval.decoder.max_len_b=5"])
    results = run(cfg)
    assert results["status"] == "completed" and results["averaged_checkpoints"] == ["step2.ckpt", "step4.ckpt"]
    assert isinstance(results["test_bleu_avg"], float)
    steps = {p.name: p for p in step_checkpoints(run_dir)}
    mine = tmp_path / "avg.ckpt"
    # the average written out here (not averaging.py's): each float tensor's mean in float64, rounded
    # once to its dtype; the integer buffers (LayerDrop's draw counter) the last checkpoint's
    first, last = (torch.load(steps[n], map_location="cpu", weights_only=False) for n in results["averaged_checkpoints"])
    mean = {k: ((first["state_dict"][k].double() + v.double()) / 2).to(v.dtype) if v.is_floating_point() else v
            for k, v in last["state_dict"].items()}
    torch.save({"state_dict": mean, **{k: last[k] for k in ("model_config", "tokenizer_proto") if k in last}}, mine)
    want = independent_scores(run_dir, cfg, mine, "test", dict(cfg.eval.test_decoder))
    written = json.loads((run_dir / "results.json").read_text())
    assert {k: written[f"test_{k}_avg"] for k in ("loss", "nll", "ppl", "bleu", "chrf")} == {
        k: want[k] for k in ("loss", "nll", "ppl", "bleu", "chrf")}


def test_average_refuses_mismatched_architectures(tmp_path, capsys):
    base = fake_ckpt(tmp_path / "a.ckpt", {"model.w": torch.zeros(2)})
    cases = {
        "model_config differs in d_model=16 vs 8": fake_ckpt(tmp_path / "b.ckpt", {"model.w": torch.zeros(2)}, d_model=16),
        "differ in shape: model.w (3,) vs (2,)": fake_ckpt(tmp_path / "c.ckpt", {"model.w": torch.zeros(3)}),
        "missing model.w; extra model.v": fake_ckpt(tmp_path / "d.ckpt", {"model.v": torch.zeros(2)}),
        "different tokenizers": fake_ckpt(tmp_path / "e.ckpt", {"model.w": torch.zeros(2)}, proto=b"other"),
    }
    for message, other in cases.items():
        with pytest.raises(CheckpointMismatch, match=message.replace("(", r"\(").replace(")", r"\)")):
            average_checkpoints([base, other])
    assert call(average.main, base, tmp_path / "b.ckpt", "--output", tmp_path / "x.ckpt") == 2
    assert "cannot average" in capsys.readouterr().err and not (tmp_path / "x.ckpt").exists()


def test_step_checkpoints_are_ordered_by_step(tmp_path):
    for name in ("step10.ckpt", "step9.ckpt", "step100.ckpt", "best-step5.ckpt", "last.ckpt", "avg-last5.ckpt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step9.ckpt", "step10.ckpt", "step100.ckpt"]


def test_default_config_tests_like_the_papers():
    from normlab.config import ConfigError
    from normlab.run_config import validate_run_config

    cfg = compose_cfg([])
    assert dict(cfg.eval.test_decoder) == {"beam": 4, "lenpen": 0.6, "max_len_a": 1.0, "max_len_b": 50, "min_len": 0}
    assert cfg.eval.decoder.beam == 1 and cfg.eval.test_greedy and cfg.eval.test_average
    assert cfg.callbacks.step_checkpoints.keep_last_n == 5 and cfg.callbacks.step_checkpoints.every_n_steps > 0
    with pytest.raises(ConfigError, match="eval.test_decoder.beam"):
        validate_run_config(compose_cfg(["eval.test_decoder.beam=0"]))


def test_average_last_names_the_file_by_what_it_averaged(trained, tmp_path, capsys):
    """--last 50 on a run with fewer step checkpoints: the default output says how many it averaged."""
    run_dir, _, _ = trained
    n = len(step_checkpoints(run_dir))
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for p in (copy / "checkpoints").glob("avg-last*.ckpt"):
        p.unlink()
    assert call(average.main, copy, "--last", 50) == 0
    assert "only" in capsys.readouterr().out
    assert [p.name for p in (copy / "checkpoints").glob("avg-last*.ckpt")] == [f"avg-last{n}.ckpt"]


def test_translate_refuses_a_nul_byte_from_a_file_as_from_stdin(trained, tmp_path, capsys):
    run_dir, _, _ = trained
    src = tmp_path / "bin.de"
    src.write_bytes(b"Im Anfang\nschuf\x00Gott\n")
    assert call(translate.main, run_dir, "--input", src, *DECODE) == 2
    err = capsys.readouterr().err
    assert err == f"error: {src}:2: NUL byte: binary input, not text (translate reads UTF-8 text, one sentence per line)\n"


def test_usage_names_the_console_script(monkeypatch):
    """normlab.cli tells errors which console script runs (not read from sys.argv inside)."""
    from normlab import cli, errors
    from normlab.errors import CommandParser, UserError

    monkeypatch.setattr(errors, "_console_script", None)
    assert CommandParser(prog="python -m normlab.commands.translate").prog == "python -m normlab.commands.translate"
    monkeypatch.setattr(sys, "argv", ["normlab-translate", "--bogus"])
    with pytest.raises(SystemExit) as e:
        cli.translate()
    assert e.value.code == 2 and errors._console_script == "normlab-translate"
    with pytest.raises(UserError, match=r"^normlab-translate: .*\(see normlab-translate --help\)"):
        CommandParser(prog="python -m normlab.commands.translate").parse_args(["--bogus"])
    monkeypatch.setattr(errors, "_console_script", None)
    cli_export = cli.export_admin
    monkeypatch.setattr(sys, "argv", ["normlab-export-admin", "--bogus"])
    with pytest.raises(SystemExit):
        cli_export()
    assert errors._console_script == "normlab-export-admin"
