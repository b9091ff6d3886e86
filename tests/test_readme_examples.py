"""Every command example in README.md and docs/*.md runs as written (on a tiny run), so a change
cannot break one silently. One test case per example, named by its file and line (`docs/data.md:23`).

How an example is found and run (conventions for whoever adds one):
- An example is a line of a ```bash block (lines ending in a backslash are joined; `# ...`
  comments dropped). `python train.py ...` / `normlab-train ...` run the training entry point,
  `python -m normlab.commands.<cmd> ...` / `normlab-<cmd> ...` run that command, both in-process
  (the same `main(argv)` the console scripts call) in a fresh temporary working folder, and must
  exit 0. `echo "text" | <command>` feeds the text on stdin; `for d in <folders>; do <command>
  "$d" ...; done` runs the command on the tiny run.
- Training examples keep their own overrides and get TINY appended (the tiny corpus and model, one
  step, no test, CSV logging unless the example picks a logger), so an override that no longer
  composes or validates fails here. A sweep (`-m`) runs its first job only: comma lists become
  their first value and a sweep file's parameters are dropped (tests/test_sweeps.py checks every
  job of every sweep file). An example whose trainer needs a GPU or several devices is composed
  and validated only; so is `torchrun <its flags> train.py ...` (2 processes: tests/test_engines.py
  runs each engine and compares it with Lightning's own DDP).
- Placeholders (each example gets its own copy of the runs): `$RUN`, `RUN_DIR`, `RUN_DIR_OR_CKPT`,
  `outputs/<run>` = a tiny trained 3+3-layer pre-norm run (5 step checkpoints and their average, as
  training writes them); `pruned.ckpt` and `$RUN/prune/checkpoints/<x>.ckpt` (when the example's own
  prune line has not made it) = that run pruned to 2 layers; `ADMIN_RUN` = a tiny trained Admin
  run; `multirun/<anything>` = a sweep folder holding the tiny run; `RUN=...` lines (any shell
  assignment) name the placeholder here, and are run by bash on their own test (they must name the
  run they say); `key=<placeholder>` overrides are substituted too. Input files: `data/bible_de_en/test.de.gz`, `test.de`, `src.de` (and `test.en`
  after `--ref`) = the tiny test split; `data/wmt14_en_de/` = the tiny corpus's folder
  (train/valid/test.{de,en}); `a.ckpt`, `b.ckpt` = two of the run's step checkpoints.
  Decoding commands get `--max-len-a 0 --max-len-b 5` appended (an untrained model never ends a
  sentence; the flags only bound the time), preprocess gets `--vocab-size 300` (the tiny corpus
  cannot fill a paper-size vocabulary).
- Examples that are not normlab commands or cannot run here are listed in NOT_RUN with the reason
  (installs, CI itself, corpora that are downloaded by hand).
"""
import io
import json
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from normlab.commands import average, evaluate, export_admin, preprocess, prune, report, runs, translate
from normlab.commands.common import main_guard
from normlab.commands.train import main as train_main
from normlab.run_config import validate_run_config

from conftest import ROOT, compose_cfg, tiny_overrides

# The README and every docs page: each example is run where it is written
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = {"translate": translate, "evaluate": evaluate, "average": average, "prune": prune,
            "report": report, "export_admin": export_admin, "export-admin": export_admin, "preprocess": preprocess,
            "runs": runs}
DECODING = ("translate", "evaluate", "prune")
NOT_RUN = {  # first words of the example -> why this test does not run it
    "make": "the Makefile targets: CI runs `make test` itself; `make train` is the full default run",
    "python3 -m venv": "GPU install steps (a CUDA torch download)",
    ".venv/bin/pip": "GPU install steps (a CUDA torch download)",
    "python scripts/prepare_corpus.py": "needs corpora downloaded by hand; tests/test_prepare_corpus.py runs it",
    ".venv/bin/python benchmarks/": "benchmarks are timed runs for the record (benchmarks/README.md), here on a GPU",
    "python benchmarks/": "benchmarks are timed runs for the record (benchmarks/README.md)",
    "bash benchmarks/gpu_check.sh": "the GPU check needs CUDA; tests/test_gpu_check.py runs its dry run through the "
                                    "script",
    "normlab-study": "a study runs real training processes; tests/test_study.py runs the command on smoke budgets "
                     "(SIGTERM and continuation, the README it writes, every study's arms composed); "
                     "tests/test_study_status.py its --status, tests/test_study_verify.py its --verify",
    "srun": "the body of an sbatch script (a SLURM job step); its train.py overrides are the ones the launcher "
            "example above composes",
}


@dataclass
class Example:
    page: str  # the file, relative to the checkout: README.md, docs/data.md
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def page_examples(page: Path) -> list[Example]:
    text, out, name = page.read_text(encoding="utf-8"), [], page.relative_to(ROOT).as_posix()
    for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
        first = text[:block.start()].count("\n") + 2
        pending, start = "", None
        for i, raw in enumerate(block.group(1).split("\n")):
            start = first + i if not pending else start
            pending += raw.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            command = " ".join(shlex.split(pending, comments=True))
            if command and not re.match(r"^[A-Z_]+=", command):  # RUN=... names a placeholder
                out.append(Example(name, start, pending))
            pending = ""
    return out


EXAMPLES = [example for page in PAGES for example in page_examples(page)]


def not_run_reason(example: Example) -> str | None:
    return next((why for start, why in NOT_RUN.items() if example.text.lstrip().startswith(start)), None)


@pytest.fixture(scope="module")
def tiny_runs(small_corpus, tmp_path_factory):
    """The placeholders' runs, trained once."""
    tmp = tmp_path_factory.mktemp("readme")
    capped = ["eval.decoder.max_len_a=0", "eval.decoder.max_len_b=5", "eval.test_decoder.max_len_a=0",
              "eval.test_decoder.max_len_b=5"]
    sweep = tmp / "multirun"

    def train(run_dir: Path, *extra: str) -> None:  # as a user does: Hydra writes .hydra/config.yaml
        over = [o for o in tiny_overrides(small_corpus, run_dir, tmp / "cache") if not o.startswith("+run_dir")]
        assert train_main([*over, *capped, *extra, f"hydra.run.dir={run_dir}"]) == 0

    train(sweep / "0_prenorm", "trainer.max_steps=6", "trainer.val_check_interval=3",
          "callbacks.step_checkpoints.every_n_steps=1", "model.encoder_layers=3", "model.decoder_layers=3")
    train(tmp / "admin", "norm=postnorm", "init=admin", "trainer.max_steps=2", "trainer.val_check_interval=2",
          "eval.test=false")
    steps = sorted((sweep / "0_prenorm" / "checkpoints").glob("step*.ckpt"))
    assert main_guard(prune.main, [str(sweep / "0_prenorm"), "--strategies", "every_other", "--depths", "2",
                                   "--save-checkpoints", "--beam", "1", "--max-len-a", "0", "--max-len-b", "5",
                                   "--out", str(tmp / "pruned"), "-q"]) == 0
    (pruned,) = (tmp / "pruned" / "checkpoints").glob("*.ckpt")
    return {"run": sweep / "0_prenorm", "admin": tmp / "admin", "sweep": sweep, "steps": steps,
            "corpus": small_corpus, "cache": tmp / "cache", "pruned": pruned}


def own_copy(runs: dict, tmp_path: Path) -> dict:
    shutil.copytree(runs["sweep"], tmp_path / "multirun")
    shutil.copytree(runs["admin"], tmp_path / "admin")
    run_dir = tmp_path / "multirun" / runs["run"].name
    return {**runs, "sweep": tmp_path / "multirun", "run": run_dir, "admin": tmp_path / "admin",
            "steps": [run_dir / "checkpoints" / p.name for p in runs["steps"]]}


def substitute(tokens: list[str], runs: dict) -> list[str]:
    corpus, out = runs["corpus"], []
    literal = {"data/bible_de_en/test.de.gz": corpus["test_src"], "data/bible_de_en/test.en.gz": corpus["test_tgt"],
               "data/bible_de_en/valid.de.gz": corpus["valid_src"], "test.de": corpus["test_src"],
               "src.de": corpus["test_src"], "a.ckpt": str(runs["steps"][-2]), "b.ckpt": str(runs["steps"][-1]),
               "ADMIN_RUN": str(runs["admin"])}
    for i, tok in enumerate(tokens):
        key, eq, tok = tok.rpartition("=") if re.match(r"^[\w.+~]+=", tok) else ("", "", tok)  # key=<placeholder>
        tok = re.sub(r"^(\$RUN|RUN_DIR_OR_CKPT|RUN_OR_CKPT|RUN_DIR|outputs/<run>)(?=/|$)", str(runs["run"]), tok)
        tok = re.sub(r"^data/wmt14_en_de/", str(Path(corpus["train_src"]).parent) + "/", tok)
        tok = re.sub(r"^multirun/[^ ]*?(?=/\*|$)", str(runs["sweep"]), tok) if tok.startswith("multirun/") else tok
        if tok == "test.en" and i and tokens[i - 1] == "--ref":
            tok = corpus["test_tgt"]
        tok = literal.get(tok, tok)
        if tok == "pruned.ckpt" or (re.search(r"/prune/checkpoints/[^/]+\.ckpt$", tok) and not Path(tok).exists()):
            tok = str(runs["pruned"])
        out.append(key + eq + tok)
    return out


def first_job(args: list[str]) -> list[str]:
    """A sweep's first job: `key=a,b` -> `key=a` (not inside brackets or quotes)."""
    return [a if a.startswith("-") or "=" not in a or "[" in a else a.split(",")[0] for a in args]


def tiny(runs: dict, args: list[str]) -> list[str]:
    over = [o for o in tiny_overrides(runs["corpus"], runs["run"], runs["cache"]) if not o.startswith("+run_dir")]
    if any(a.startswith("logger=") for a in args):
        over = [o for o in over if not o.startswith("logger=")]
    if any(a.startswith("resume=") for a in args):  # the model comes from the checkpoint
        over = [o for o in over if not o.startswith("model.")]
    if "data=preprocessed" in args:  # a folder, not corpus files: the example's own data.path stays
        over = [o for o in over if not o.startswith(("data.train_", "data.valid_", "data.test_", "data.vocab_size",
                                                       "data.cache_dir"))]
    # resume= continues the step count: one step past the tiny run's 6 (fewer is refused, one line)
    steps = 7 if any(a.startswith("resume=") for a in args) else 1
    return over + ["model.max_positions=256", f"trainer.max_steps={steps}", "trainer.val_check_interval=1",
                   "eval.test=false", "callbacks.step_checkpoints.keep_last_n=0", "eval.decoder.max_len_a=0",
                   "eval.decoder.max_len_b=5"]


def run_train(args: list[str], runs: dict, tmp_path: Path) -> None:
    if args and args[0] in ("--help", "--cfg"):
        assert train_main(args) == 0
        return
    multirun = "-m" in args or "--multirun" in args
    overrides = first_job([a for a in args if a not in ("-m", "--multirun")]) + tiny(runs, args)
    cfg = compose_cfg(overrides)
    if cfg.trainer.accelerator == "gpu" or cfg.trainer.devices not in (1, "1", "auto"):
        validate_run_config(cfg)  # a GPU / multi-device example: composed and validated only
        return
    if multirun:
        sweeper = ["hydra.sweeper.n_trials=1"] if "optuna" in " ".join(args) else ["hydra.sweeper.params=null"]
        argv = ["-m", *overrides, *sweeper, f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    else:
        argv = [*overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    assert train_main(argv) == 0
    (results,) = (tmp_path / ("sweep" if multirun else "run")).rglob("results.json")
    debug = any(a.startswith("debug=") for a in args)  # a debug run is never finished (conf/debug)
    assert f'"status": "{"debug" if debug else "completed"}"' in results.read_text()
    if "callbacks.observatory.enabled=true" in args:  # its statistics of the validation at step 1, per layer
        assert json.loads(results.read_text())["observatory"]["layers"]["enc.0.self_attn"]["entropy_h0"] > 0


def run_command(name: str, args: list[str], stdin: str | None, monkeypatch, capsys) -> None:
    if name in DECODING:
        args = args + ["--max-len-a", "0", "--max-len-b", "5"]
    if name == "preprocess":
        args = args + ["--vocab-size", "300"]
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8"))
    assert main_guard(COMMANDS[name].main, args) == 0
    if name == "runs":  # run in the examples' folder, where multirun/ holds the tiny run, which completed
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        assert ["multirun/0_prenorm", "completed"] in [row[:2] for row in rows], rows


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_readme_example_runs(example, tiny_runs, tmp_path, monkeypatch, capsys):
    reason = not_run_reason(example)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    tiny_runs = own_copy(tiny_runs, tmp_path)  # examples write into run folders (eval/, prune/)
    text = example.text
    loop = re.match(r"for (\w+) in (\S+); do (.*); done$", text.strip())
    if loop:  # the body on the tiny run
        text = loop.group(3).replace(f'"${loop.group(1)}"', "$RUN").replace(f"${loop.group(1)}", "$RUN")
    stdin = None
    if "|" in text:
        left, text = text.split("|", 1)
        assert shlex.split(left)[0] == "echo", example
        stdin = " ".join(shlex.split(left)[1:]) + "\n"
    tokens = substitute(shlex.split(text, comments=True), tiny_runs)
    if tokens[0] == "torchrun" and "train.py" in tokens:  # the launcher's flags, then train.py's overrides
        tokens = ["python", *tokens[tokens.index("train.py"):]]
    if tokens[:2] in (["python", "train.py"], [".venv/bin/python", "train.py"]) or tokens[0] == "normlab-train":
        run_train(tokens[1 if tokens[0] == "normlab-train" else 2:], tiny_runs, tmp_path)
    elif tokens[:2] == ["python", "-m"] and tokens[2].startswith("normlab.commands."):
        run_command(tokens[2].split(".")[-1], tokens[3:], stdin, monkeypatch, capsys)
    elif tokens[0].startswith("normlab-"):
        run_command(tokens[0].removeprefix("normlab-"), tokens[1:], stdin, monkeypatch, capsys)
    else:
        pytest.fail(f"{example}: not a command this test knows: {example.text!r}; run it here or add it to "
                    "NOT_RUN with the reason (see the conventions at the top of this file)")
    check_promises(example, tokens, tiny_runs)


def check_promises(example: Example, tokens: list[str], runs: dict) -> None:
    """What the example says it does, beyond exit 0: the files it names (--output / -o, or `# -> PATH`
    in its comment) exist; an evaluation against references is not a score of the hypotheses against
    themselves (the old README example scored BLEU 100)."""
    for flag in ("--output", "-o"):
        if flag in tokens[:-1]:
            out = Path(tokens[tokens.index(flag) + 1])
            assert out.is_file() and out.stat().st_size > 0, f"{example}: {out} not written"
    arrow = re.search(r"#\s*->\s*(\S+)", example.text)
    if arrow:
        promised = substitute([arrow.group(1)], runs)[0]
        pattern = re.sub(r"<[^>]*>", "*", promised)
        assert list(Path("/").glob(pattern.lstrip("/"))) if pattern.startswith("/") else list(Path().glob(pattern)), \
            f"{example}: promised {arrow.group(1)} ({pattern}) not written"
    if "evaluate" in " ".join(tokens[:3]) and "--ref" in tokens and "--output" in tokens:
        scores = json.loads(Path(tokens[tokens.index("--output") + 1]).read_text())
        assert scores["bleu"] < 100, f"{example}: BLEU {scores['bleu']}: the references are the hypotheses"


def test_the_readme_has_examples_of_every_command():
    text = " ".join(e.text for e in EXAMPLES)
    for name in ("train.py", "translate", "evaluate", "average", "prune", "report", "export_admin"):
        assert name in text, name


def readme_assignments() -> list[Example]:
    """The shell assignments (`RUN=$(...)`) of the README and docs/ pages, which name the run the lines
    after them use."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
            first = text[:block.start()].count("\n") + 2
            out += [Example(str(page.relative_to(ROOT)), first + i, raw.strip())
                    for i, raw in enumerate(block.group(1).split("\n")) if re.match(r"^[A-Z_]+=", raw.strip())]
    return out


def test_the_docs_have_run_lines():
    """The RUN= lines exist where the test below looks for them (an empty list would skip it silently)."""
    assert readme_assignments()


@pytest.mark.parametrize("example", readme_assignments(), ids=str)
def test_readme_run_lines_name_the_default_run(example, tmp_path):
    """`RUN=$(ls -d outputs/bible_de_en-pre_ln-xavier-none-e3d3-s1-* | head -1)   # the default run's folder`,
    run by bash where outputs/ holds the default run (`python train.py`) and a run of the debug options of
    the same config (`python train.py debug=fdr`, ...; debug=profiler is named in a Hydra run only: its
    identity reads the output folder): it names the default run, the only one its glob finds. (Debug runs have no checkpoint: when the glob found one first, the translate after it failed.)"""
    import subprocess

    from normlab import identity

    m = re.match(r"^[A-Z_]+=\$\((.*)\)\s*#\s*(.*)$", example.text)
    assert m and m.group(2) == "the default run's folder", f"{example}: a RUN= line this test does not know"
    names = {mode: identity.run_name(compose_cfg([f"debug={mode}"] if mode else []))
             for mode in (None, "fdr", "limit", "overfit")}
    for name in names.values():
        (tmp_path / "outputs" / name).mkdir(parents=True)
    assert len(set(names.values())) == 4

    def bash(command: str) -> list[str]:
        return subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout.split()

    assert bash(m.group(1)) == bash(m.group(1).split("|")[0]) == [f"outputs/{names[None]}"]
