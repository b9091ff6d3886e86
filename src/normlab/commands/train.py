"""Train and score one model, or a sweep with -m: `python train.py`, `normlab-train` or
`python -m normlab.commands.train`, all with Hydra overrides.

    python train.py norm=postnorm model.encoder_layers=6 seed=3
    python train.py -m norm=postnorm,prenorm model.encoder_layers=6,12
    python train.py --help                            # config groups and options

A bad override, config value, corpus or checkpoint ends in one line on stderr,
`error: <key or file:line>: <what> (allowed: ...)`, exit status 2, and leaves no run folder
behind (Hydra creates it before the job starts; it is removed when it holds nothing but Hydra's
own files). In a sweep the job is recorded as failed (results.json) and the sweep goes on.
NORMLAB_TRACEBACK=1 (or HYDRA_FULL_ERROR=1) shows the traceback instead.

A second copy of a running command (its run folder held by another process: run_folder.locked) is
refused before it writes anything there, .hydra/ and the log included: one line, exit status 2. In
a multirun each refused job prints its line, the other jobs run, and the multirun exits 2 with a line
naming the sweep folder. Under a launcher that runs each job in a process of its own
(hydra/launcher=submitit_local, slurm) a refused job's line goes to its log there, and the multirun,
once its jobs have run, prints the first refused job's line and exits 2 as well.
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import os
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig

import normlab.resolvers  # registers the resolvers conf/hydra names run folders with (nl.run_name, nl.study)
from normlab.errors import EXIT_USER_ERROR, UserError, one_line, show_tracebacks, user_error_types

log = logging.getLogger("normlab")


def config_dir() -> Path:
    """conf/ of the checkout this package runs from (an editable install), else ./conf."""
    for cand in (Path(__file__).resolve().parents[3] / "conf", Path.cwd() / "conf"):
        if (cand / "config.yaml").is_file():
            return cand
    raise UserError("conf/config.yaml", "not found: run normlab-train from a normlab checkout")


def train_user_errors() -> tuple[type[BaseException], ...]:
    """What a user fixes in the config or the files: normlab's errors, and Hydra's and OmegaConf's
    (an unknown key, a missing ??? value, a bad interpolation, a target that rejects its arguments)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (*user_error_types(), HydraException, OmegaConfBaseException)


_failed: list[BaseException] = []  # the error of a single run, raised again by main()
_refused: list[Path] = []  # the sweep folder of each multirun job whose folder another process holds: exit 2
_main_process: list[int] = []  # main()'s process: a job in another one (a launcher's worker) cannot add to _refused
HYDRA_RECORD = ".hydra"  # Hydra's default hydra.output_subdir, saved by the job (save_hydra_record)


def task(cfg: DictConfig) -> float | None:
    """The Hydra job: hold the folder, record the config, resolve (validate) and run; on failure record
    it (sweep) or clean up (single run)."""
    from normlab import process_group
    from normlab.failure import record_failure
    from normlab.run_folder import RunFolderInUse, locked, rank_zero
    from normlab.run_identity import hydra_runtime
    from normlab.run_spec import resolve

    normlab.resolvers.register_resolvers()  # a submitit worker unpickles this function without importing train.py
    runtime = hydra_runtime()  # the job's Hydra values, read once here and passed on
    run_dir = Path(runtime.output_dir)
    single = not runtime.multirun
    # torchrun / SLURM / submitit started this process as one rank of the run: its rank is known from
    # here on (a submitit task is given torch's variables), and a rank above 0 logs to a file of its own
    process_group.join(runtime.job_name)
    try:
        # Held before anything is written into the folder: a second copy of a running command is
        # refused with the running run's .hydra/ as it ran (issue 37: it had rewritten it already),
        # and until a failed run's record is written (a copy started meanwhile would have taken the
        # folder between the run's end and its record)
        with locked(run_dir, rank_zero()):
            try:
                process_group.check(cfg.trainer)  # the launcher's process count is the run's
                if rank_zero():  # DDP ranks (Lightning's, torchrun's, SLURM's) share rank 0's folder and record
                    save_hydra_record(run_dir, cfg, runtime.record)
                spec = resolve(cfg, runtime)  # named as its folder was, validated: before normlab.train is imported
                from normlab.callbacks.progress import console_setup
                from normlab.train import run_resolved

                console_setup()  # before the Trainer prints its first lines
                result = run_resolved(spec)  # a RunResult (run_result.py)
            except Exception as err:
                if not (single and isinstance(err, train_user_errors())
                        and (not rank_zero() or discard_if_untouched(run_dir, runtime.job_name))):
                    record_failure(cfg, err, runtime)  # results.json status failed; a multirun goes on
                if single:  # main() reports it once the Hydra app returns (Hydra would add lines of its own)
                    _failed.append(err)
                return None
    except RunFolderInUse as err:  # the folder is another process's: write nothing there
        refuse(err, run_dir, None if single else Path(runtime.sweep_dir or run_dir.parent))
        if not single and os.getpid() not in _main_process:
            # a launcher's worker (submitit, joblib): the job fails, so that Hydra's sweeper raises the
            # refusal in main()'s process once the jobs have run, and the multirun exits 2 there too
            raise
        return None
    return result.objective()  # what an Optuna sweeper maximises


def save_hydra_record(run_dir: Path, cfg: DictConfig, hydra_cfg: DictConfig) -> None:
    """What Hydra writes into a job's folder before the job starts (hydra.output_subdir), written
    by the job once it holds the folder (conf/hydra/default.yaml turns Hydra's off): the job's config,
    Hydra's config (`hydra_cfg`, {hydra: ...} as run_job copies it: run_identity.Runtime.record) and the
    command line's overrides, as Hydra 1.3 writes them (core/utils.py run_job, _save_config:
    OmegaConf.to_yaml, unresolved; tests/test_run_lock.py compares the bytes)."""
    from omegaconf import OmegaConf

    from normlab.file_mode import atomic_write_bytes

    out = run_dir / HYDRA_RECORD
    out.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra_cfg),
                       ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
        text = OmegaConf.to_yaml(node).encode("utf-8")
        atomic_write_bytes(out / name, lambda f, text=text: f.write(text))  # a kill leaves old or new, never half


def refuse(err: BaseException, run_dir: Path, sweep: Path | None) -> None:
    """A job whose folder another process holds wrote nothing there, and adds nothing: the log file
    Hydra opened there for it is closed (it is the holder's; a sweep's next launch line would land in
    it), its one line goes to stderr (main() prints a single run's), a multirun (`sweep`: its
    folder) counts it."""
    import logging

    root, folder = logging.getLogger(), Path(os.path.abspath(run_dir))
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == folder:
            root.removeHandler(handler)
            handler.close()
    if sweep is None:
        _failed.append(err)
    else:
        print(one_line(err), file=sys.stderr, flush=True)
        _refused.append(sweep)


def refused_line(sweeps: list[Path]) -> str:
    """The multirun's closing line, in the house form `error: <where>: <what>`: where is the sweep
    folder (several, if the sweeper moved between folders)."""
    where = ", ".join(str(s) for s in dict.fromkeys(sweeps))
    return one_line(UserError(where, f"{len(sweeps)} job(s) of this multirun did not run: their run folders are in "
                                     "use by another process (above); rerun the same command once it ends"))


def discard_if_untouched(run_dir: Path, job_name: str) -> bool:
    """Remove a run folder holding only what Hydra wrote before the job (.hydra/, <job>.log), the
    run's identity record (run.json, written before the data is read) and its tokenizer (a copy of
    the data's or the start checkpoint's, saved before the start weights are checked), and its
    parents that are left empty (up to the working directory); never a folder with a run's work
    (checkpoints, results). Called while the folder is held: its lock file goes with it."""
    from normlab.run_folder import LOCK_FILE, RUN_FILE

    hydra_own = {".hydra", f"{job_name}.log", RUN_FILE, "tokenizer", LOCK_FILE}
    if not run_dir.is_dir() or any(p.name not in hydra_own for p in run_dir.iterdir()):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    cwd, parent = Path.cwd().resolve(), run_dir.resolve().parent
    while parent != cwd and cwd in parent.parents:
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
        parent = parent.parent
    return True


def hydra_error_line(err: BaseException, argv: list[str]) -> str:
    """Hydra's composition errors as one line naming the override."""
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options:
        group, _, name = err.missing_cfg_file.rpartition("/")
        return str(UserError(f"{group}={name}", f"no such {group} option", err.options))
    text = str(err)
    if text.startswith("Could not override '"):  # a key that is not in the config
        key = text.split("'")[1]
        value = next((a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == key), "...")
        allowed = known_keys(argv, key)
        close = difflib.get_close_matches(key.rpartition(".")[2], allowed or [], n=1)
        hint = f"did you mean {key.rpartition('.')[0] + '.' if '.' in key else ''}{close[0]}? " if close else ""
        return str(UserError(key, f"not a config key ({hint}to add a new key: +{key}={value})"))
    return one_line(err).removeprefix("error: ")


def known_keys(argv: list[str], key: str) -> list[str] | None:
    """The keys beside `key` (same parent) in the config composed without the offending override."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    others = [a for a in argv if not a.startswith("-") and "=" in a and a.split("=", 1)[0] != key]
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(config_name="config", overrides=others)
        parent = OmegaConf.select(cfg, key.rpartition(".")[0]) if "." in key else cfg
        return sorted(str(k) for k in parent.keys()) if isinstance(parent, DictConfig) else None
    except Exception:  # the other overrides have errors of their own: no hint
        return None


def main(argv: list[str] | None = None) -> int:
    """Run train.py's Hydra app on argv; the exit status (0, 2 for a user error, 1 for a bug)."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from normlab.private_api import hydra_app_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    tracebacks = show_tracebacks()
    app = hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(task)
    saved_env = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own trace
    _failed.clear()
    _refused.clear()
    _main_process[:] = [os.getpid()]
    try:
        with hydra_app_argv(argv), _root_logging_restored():
            app()
        if _failed:
            raise _failed.pop()
        if _refused:  # the other jobs ran; each refused one printed its line when it was refused
            print(refused_line(_refused), file=sys.stderr)
            return EXIT_USER_ERROR
    except SystemExit as e:  # --help, argparse errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except (HydraException, OmegaConfBaseException) as e:
        if tracebacks:
            raise
        print(f"error: {hydra_error_line(e, argv)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except user_error_types() as e:
        if tracebacks:
            raise
        print(one_line(e), file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception:  # a bug: its traceback (results.json has it too), exit status 1
        import traceback

        traceback.print_exc()
        return 1
    finally:
        if saved_env is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_env
    return 0


@contextlib.contextmanager
def _root_logging_restored():
    """Hydra configures the root logger for its job (console + <run>/train.log, opened at the first
    line: conf/hydra/default.yaml) and leaves it so. A caller that goes on in the same process (a
    study, a test) must not log into the last job's file, which a refused job never created: the
    handlers Hydra added are closed and the caller's come back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def cli() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    cli()
