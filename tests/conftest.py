import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads; see normlab/__init__.py

import gzip
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import compose_cache
import normlab.resolvers  # noqa: F401  (the config's nl.* resolvers, as train.py registers them)

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")

# Each config composed once per test process (tests/compose_cache.py: Hydra's first step cached, its
# second done by Hydra's own function), before the test modules import `from hydra import compose`.
compose_once = compose_cache.install()
from hydra import compose, initialize_config_dir  # noqa: E402  (compose: compose_once)

# The fixtures that train or run a command through the entry point: a test that requests one,
# itself or through another fixture (item.fixturenames is the closure), is an integration test,
# left out of `make test-fast`. tests/pyramid.py is the rule; tests/test_pyramid.py keeps this set
# equal to the fixtures that enter, and a test that enters by itself carries the mark in its file.
TRAINING_FIXTURES = frozenset({
    "admin_run", "dry_run", "finetuned", "finished_run", "layerdrop_run", "lightning_ddp", "pruned", "reference", "resolved", "runs", "scored_run", "smoke",
    "start",
    "three_logger_run", "tiny_checkpoint", "tiny_runs", "trained", "two_runs", "whole",
})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(items):
    for item in items:
        if TRAINING_FIXTURES.intersection(getattr(item, "fixturenames", ())) and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    # The tests' models are tiny and the CPU is shared: extra intra-op threads only wait on each
    # other (beam search on a tiny model measured 200x slower with 2 threads on a loaded 2-core
    # machine). NORMLAB_TEST_THREADS overrides.
    n = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("NORMLAB_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True, scope="session")
def compose_cache_shared(tmp_path_factory):
    # Under pytest -n: the run's workers share the composed bases (tests/compose_cache.py), in the run's
    # own folder (each worker's basetemp is a folder of it), so a base is composed once per run.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "compose_cache"
        folder.mkdir(exist_ok=True)
        compose_cache.shared = folder
    yield
    compose_cache.shared = None


def read_lines(path: Path, n: int, skip: int = 0) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    return lines[skip:skip + n]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> dict[str, str]:
    """A few hundred real de-en pairs from the bundled corpus, as plain files."""
    out = tmp_path_factory.mktemp("corpus")
    src = ROOT / "data" / "bible_de_en"
    spec = {"train": ("valid", 600, 0), "valid": ("test", 40, 0), "test": ("test", 40, 40)}
    paths = {}
    for split, (origin, n, skip) in spec.items():
        for lang in ("de", "en"):
            p = out / f"{split}.{lang}"
            p.write_text("\n".join(read_lines(src / f"{origin}.{lang}.gz", n, skip)) + "\n", encoding="utf-8")
            paths[f"{split}_{'src' if lang == 'de' else 'tgt'}"] = str(p)
    return paths


def tiny_overrides(corpus: dict[str, str], run_dir: Path, cache: Path) -> list[str]:
    """A model and budget small enough for a few seconds of CPU."""
    return [f"data.{k}={v}" for k, v in corpus.items()] + [
        "data.vocab_size=300", "data.max_tokens=512", f"data.cache_dir={cache}",
        "model.d_model=32", "model.encoder_ffn=64", "model.decoder_ffn=64",
        "model.encoder_layers=2", "model.decoder_layers=2",
        "trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.log_every_n_steps=2",
        "trainer.enable_progress_bar=false", "optim.warmup=4",
        "logger=csv", "name=tiny-test", f"++run_dir={run_dir}",
    ]


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


class CrashAtStep:
    """A callback that raises at a given step (a bug in the middle of training, for failure tests):
    `+callbacks.crash._target_=conftest.CrashAtStep +callbacks.crash.step=2` with PYTHONPATH=tests."""

    def __new__(cls, step: int = 1):
        from lightning.pytorch.callbacks import Callback

        class _Crash(Callback):
            def on_train_batch_end(self, trainer, *args):
                if trainer.global_step >= step:
                    raise RuntimeError(f"crash at step {trainer.global_step} (conftest.CrashAtStep)")

        return _Crash()


def wandb_records(path: Path):
    """The records of a W&B run file (normlab.wandb_files: the format's one reader)."""
    from normlab.wandb_files import records

    return records(path)


class SpikeAtStep:
    """A callback that multiplies the gradient of the update at 0-based `step` by `factor` before the
    optimizer step (a spike, for optim.skip_spikes): `+callbacks.spike._target_=conftest.SpikeAtStep
    +callbacks.spike.step=5` with PYTHONPATH=tests."""

    def __new__(cls, step: int = 1, factor: float = 1e6):
        from lightning.pytorch.callbacks import Callback

        class _Spike(Callback):
            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                if trainer.global_step == step:
                    for p in pl_module.parameters():
                        if p.grad is not None:
                            p.grad.mul_(factor)

        return _Spike()


class FakeTrainer:
    """What the divergence guard reads of a Trainer, for driving it by hand."""
    global_step, world_size, precision_plugin, limit_val_batches, should_stop = 0, 1, None, 1.0, False


class FakeModule:
    """A LightningModule that prints and logs nothing (a guard driven by hand); its stats say no
    gradient norm was measured (lit_module.TrainStats)."""
    stats = SimpleNamespace(grad_norm=None)

    def print(self, *a):
        pass

    def log(self, *a, **k):
        pass


def train_cli(args: list[str], cwd: Path, timeout: int = 600) -> tuple[int, list[str]]:
    """`python train.py ARGS` in `cwd` as a user runs it (neither traceback switch set): its exit
    status and every non-empty line it printed, stdout and stderr together (log lines included)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "NORMLAB_TRACEBACK")}
    env["OMP_NUM_THREADS"] = "1"  # a shared machine: tiny models gain nothing from more
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]


def refused(args: list[str], cwd: Path, here: bool = False) -> str:
    """The one line a refused `python train.py ARGS` prints (exit status 2, nothing else, no traceback).
    here=True: train.py's main in this process (train_here), ~8 s a case faster (no imports of torch and
    Lightning); each file that uses it keeps a case in a process of its own, as a user runs it."""
    code, lines = train_here(args, cwd) if here else train_cli(args, cwd)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, lines)
    return lines[0]


def train_here(args: list[str], cwd: Path) -> tuple[int, list[str]]:
    """train_cli in this process: train.py's main in `cwd`, its exit status and every non-empty line it
    printed (Hydra's console log handler writes to the sys.stdout it finds: redirected here), each Python
    warning raised meanwhile counted as a line (pytest would otherwise swallow one a user sees)."""
    import contextlib
    import io
    import warnings

    from normlab.commands.train import main

    out, old = io.StringIO(), os.getcwd()
    env = {k: os.environ.pop(k) for k in ("HYDRA_FULL_ERROR", "NORMLAB_TRACEBACK") if k in os.environ}
    try:
        os.chdir(cwd)
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(out):
            warnings.simplefilter("always")
            code = main([str(a) for a in args])
    finally:
        os.chdir(old)
        os.environ.update(env)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    return code, lines + [f"{w.category.__name__}: {w.message}" for w in caught]


def tree(path: Path) -> dict[str, bytes]:
    """Every file below `path` and its bytes (a run folder before and after a refused command)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def cached_and_full(model, src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the decoder's output for `tgt` one position at a time with the incremental cache, the same in
    one full forward): equal for every scheme and aggregation whose cached decoding is exact."""
    memory, pad = model.encode(src)
    full = model.decode(tgt, memory, pad)
    cache = model.new_cache()
    steps = torch.cat([model.decode(tgt[:, t:t + 1], memory, pad, cache) for t in range(tgt.size(1))], dim=1)
    return steps, full
