"""A run's identity, once (issue 37 item 1): for one command line, the walk from the composed config
through the run validates it once, builds its ModelConfig from the config once and resolves its
start checkpoint once; and the folder Hydra creates, the W&B name and a study's planned folder are
one name."""
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides, wandb_records

COUNTED = {"validation": ("normlab.run_config", "validated"),  # validate_run_config's body
           "optim and eval settings": ("normlab.run_config", "optim_and_eval"),
           "ModelConfig from the config": ("normlab.run_config", "model_config_from_hydra"),
           "start checkpoint resolution": ("normlab.run_folder", "start_checkpoint_path")}


def count_calls(monkeypatch) -> dict[str, int]:
    """Wrap each COUNTED function wherever a loaded normlab module holds it (`from x import f` binds
    it in the importer too), so a call through any name counts; {what: calls so far}."""
    import importlib

    counts = dict.fromkeys(COUNTED, 0)
    for what, (module, name) in COUNTED.items():
        original = getattr(importlib.import_module(module), name)

        def counted(*args, _what=what, _f=original, **kwargs):
            counts[_what] += 1
            return _f(*args, **kwargs)

        for mod in [m for n, m in list(sys.modules.items()) if n.startswith("normlab") and m is not None]:
            for attr, value in list(vars(mod).items()):
                if value is original:
                    monkeypatch.setattr(mod, attr, counted)
    return counts


def tiny(small_corpus, tmp_path) -> list[str]:
    """The tiny run's overrides without a run_dir: Hydra's resolver names the folder."""
    return [o for o in tiny_overrides(small_corpus, tmp_path / "unused", tmp_path / "cache")
            if not o.startswith(("++run_dir", "name="))] + ["trainer.max_steps=2", "trainer.val_check_interval=2",
                                                            "callbacks.step_checkpoints.keep_last_n=0"]


def wandb_run(folder: Path):
    """The run record of the run folder's offline W&B run (its name, group, tags)."""
    (wfile,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    return next(r.run for r in wandb_records(wfile) if r.WhichOneof("record_type") == "run")


@pytest.mark.integration
def test_one_run_from_a_start_checkpoint_resolves_everything_once(small_corpus, tmp_path, monkeypatch):
    """`train.py ... finetune=<checkpoint>`: before issue 37 item 1, 2 validations, 3 typed optim / eval
    settings (each validation's, then resolve's), 3 ModelConfigs built from the config and 3 resolutions
    of the start checkpoint (the folder's resolver, run_spec.resolve, train._run); a job that fails in a
    multirun added 1 resolution (failure.record_failure)."""
    from normlab.commands.train import main
    from normlab.train import run

    from conftest import compose_cfg

    start = tmp_path / "start"
    assert run(compose_cfg(tiny_overrides(small_corpus, start, tmp_path / "cache") + ["trainer.max_steps=2"]))[
        "status"] == "completed"
    monkeypatch.chdir(tmp_path)
    counts = count_calls(monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main([*tiny(small_corpus, tmp_path), f"finetune={start / 'checkpoints' / 'last.ckpt'}",
                 "logger=[wandb,csv]"]) == 0
    assert counts == dict.fromkeys(COUNTED, 1)
    (folder,) = (tmp_path / "outputs").iterdir()
    results = json.loads((folder / "results.json").read_text())
    assert results["status"] == "completed" and results["name"] == folder.name
    assert json.loads((folder / "run.json").read_text())["name"] == folder.name
    assert wandb_run(folder).display_name == folder.name
    # a multirun job that fails after it started: recorded under the same name, nothing resolved again
    counts.update(dict.fromkeys(COUNTED, 0))
    crash = ["+callbacks.crash._target_=conftest.CrashAtStep", "+callbacks.crash.step=1"]
    assert main(["-m", *tiny(small_corpus, tmp_path), f"finetune={start / 'checkpoints' / 'last.ckpt'}", *crash,
                 "hydra.sweep.dir=sweep"]) == 0
    assert counts == dict.fromkeys(COUNTED, 1)
    (job,) = [p for p in (tmp_path / "sweep").iterdir() if p.is_dir()]  # and Hydra's multirun.yaml
    results = json.loads((job / "results.json").read_text())
    assert results["status"] == "failed" and "CrashAtStep" in results["error"] and results["name"] == job.name


# ---------------------------------------------------------------- one name for the folder, W&B and the plan
# (`resolved` runs the entry point: these tests are integration tests, conftest.TRAINING_FIXTURES)

@pytest.fixture
def resolved(monkeypatch, tmp_path):
    """`train.py ARGS` in tmp_path through Hydra (its resolvers make the folder), up to the run: the
    RunSpec each job resolved (what the run names W&B with: build_loggers gets spec.name, group, tags),
    nothing trained."""
    import normlab.train
    from normlab.commands.train import main
    from normlab.outcome import Status
    from normlab.run_result import RunResult

    specs = []

    def record(spec):
        specs.append(spec)
        return RunResult(Status.COMPLETED)

    monkeypatch.setattr(normlab.train, "_run", record)
    monkeypatch.chdir(tmp_path)

    def launch(args: list[str]) -> list:
        specs.clear()
        assert main(args) == 0
        return list(specs)

    return launch


def planned(overrides: list[str], runs: Path):
    """The study's plan of a run with these overrides (an arm of twt_lowres: its labels are no part of the
    identity, so the run is the command line's)."""
    from normlab.study.plan import make_job
    from normlab.study.spec import load_study

    study = load_study("twt_lowres")
    return make_job(study, next(iter(study.arms.values())), 1, overrides, runs, runs.parent / "record")


def start_checkpoint(path: Path, full: bool) -> Path:
    """A checkpoint whose model changes keys that others interpolate (data.max_positions follows
    model.max_positions, callbacks.drophead_schedule.p follows regularizer.drophead); full: as resume= needs."""
    state = {"model_config": {"max_positions": 64, "regularizer": {"drophead": 0.2}}, "state_dict": {}}
    torch.save(state | ({"optimizer_states": [], "loops": {}} if full else {}), path)
    return path


@pytest.mark.parametrize("args", [[], ["norm=postnorm", "seed=3"], ["finetune=START"], ["resume=START"],
                                  ["debug=profiler"]], ids=["plain", "postnorm", "finetune", "resume", "debug"])
def test_the_folder_the_wandb_name_and_the_plan_agree(args, resolved, tmp_path):
    """One command line: the folder Hydra's resolver makes, the name the run gives W&B (and run.json,
    results.json), and the folder a study plans for the same overrides are one. (Before issue 37 item 1 a
    study planned a started run by its config alone, and a debug=profiler run's name was not its folder's.)"""
    args = [a.replace("START", str(start_checkpoint(tmp_path / "start.ckpt", a.startswith("resume"))))
            for a in args]
    (spec,) = resolved(args)
    (folder,) = (tmp_path / "outputs").iterdir()
    assert spec.run_dir == folder.resolve() and spec.name == folder.name
    if args == ["debug=profiler"]:  # its config reads Hydra's output folder: composed outside Hydra, it does not resolve
        return
    job = planned(args, tmp_path / "outputs")
    assert (job.run_dir, job.run_name, job.identity_hash) == (folder, spec.name, spec.identity_hash)


def test_a_sweeps_jobs_agree_with_their_plan(resolved, tmp_path):
    specs = resolved(["-m", "norm=postnorm,prenorm", "seed=2"])
    (sweep,) = (tmp_path / "multirun").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == sorted(s.name for s in specs)
    for spec, norm in zip(specs, ("postnorm", "prenorm")):
        assert spec.run_dir == (sweep / spec.name).resolve() and spec.group == sweep.name
        job = planned([f"norm={norm}", "seed=2"], sweep)
        assert (job.run_dir, job.identity_hash) == (sweep / spec.name, spec.identity_hash)


def test_a_study_arm_is_run_as_planned(resolved, tmp_path):
    """A study's train command (its labels, its folder as hydra.run.dir), and the same overrides with the
    folder left to Hydra's resolver: one folder, one name, the study's W&B group."""
    from normlab.study.plan import plan
    from normlab.study.runner import Sweep
    from normlab.study.spec import load_study

    study = load_study("twt_lowres_2k")  # twt_lowres screens its arms first: it plans none before its screens choose
    job = next(j for j in plan(study, tmp_path / "outputs", tmp_path / "out") if j.arm.name == "post_ln_lr2e-3")
    sweep = Sweep(study, [job], tmp_path / "outputs")
    command = sweep._train_command(job)
    sweep.log_file.close()
    assert command[1:3] == ["-m", "normlab.commands.train"] and command[-1] == f"hydra.run.dir={job.run_dir}"
    (spec,) = resolved(command[3:])
    assert (spec.run_dir, spec.name, spec.identity_hash) == (job.run_dir, job.run_name, job.identity_hash)
    assert spec.group == "study-twt_lowres_2k" and spec.labels["arm"] == "post_ln_lr2e-3"
    (spec,) = resolved(command[3:-1])  # the folder named by the resolver: the one planned
    assert spec.run_dir == job.run_dir.resolve() and spec.name == job.run_name


def test_a_started_run_continues_in_the_folder_an_earlier_release_named(resolved, tmp_path):
    """finetune=: a folder an earlier release named the started run by (the checkpoint's values set on
    the resolved tree, run.json with the hash) is the one Hydra's resolver, the run and the plan take."""
    from hydra import compose, initialize_config_dir

    from normlab import resolvers

    from conftest import CONF

    args = [f"finetune={start_checkpoint(tmp_path / 'start.ckpt', full=False)}"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        name, legacy_name = resolvers._folder_names(compose(config_name="config", overrides=args,
                                                            return_hydra_config=True))
    assert legacy_name not in (None, name)
    legacy = tmp_path / "outputs" / legacy_name
    legacy.mkdir(parents=True)
    (legacy / "run.json").write_text(json.dumps({"identity_hash": name.rsplit("-", 1)[1]}))
    (spec,) = resolved(args)
    assert spec.run_dir == legacy.resolve() and spec.name == name  # W&B: the run's name, in its old folder
    assert planned(args, tmp_path / "outputs").run_dir == legacy


# ---------------------------------------------------------------- unit: identify without the entry point

def hydra_cfg(overrides: list[str]):
    """A config as a resolver gets it: with its hydra node (the typed overrides, the choices)."""
    from hydra import compose, initialize_config_dir

    from conftest import CONF

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_a_runtime_is_read_from_a_composed_hydra_node_or_is_empty():
    from normlab.run_identity import Runtime, hydra_runtime

    from conftest import compose_cfg

    rt = Runtime.of(hydra_cfg(["norm=postnorm", "seed=3"]), runs_dir="elsewhere")
    assert rt.overrides == ("norm=postnorm", "seed=3") and rt.choices["norm"] == "postnorm"
    assert not rt.multirun and rt.runs_dir == "elsewhere" and rt.output_dir is None
    assert Runtime.of(compose_cfg(["norm=postnorm"])) == Runtime()  # composed without it: outside Hydra
    assert hydra_runtime() == Runtime()  # no Hydra job in this process now


def test_the_start_checkpoint_is_read_once_for_the_folder_the_run_and_its_record(tmp_path, monkeypatch):
    """The resolver's root (with its hydra node) and the job's config (without) are one command: the
    checkpoint is read once, and the name, the record's name and hash and the run's spec agree; a
    checkpoint written anew since is read again."""
    from omegaconf import open_dict

    from normlab import resolvers
    from normlab.failure import record_failure
    from normlab.run_identity import Runtime
    from normlab.run_spec import resolve

    ckpt = start_checkpoint(tmp_path / "start.ckpt", full=False)
    root = hydra_cfg([f"finetune={ckpt}"])
    job = hydra_cfg([f"finetune={ckpt}"])
    runtime = Runtime.of(job, output_dir=str(tmp_path / "run"))
    with open_dict(job):
        del job["hydra"]  # as Hydra hands the job its config
    counts = count_calls(monkeypatch)
    folder = resolvers._resolve_run_dir(str(tmp_path / "outputs"), _root_=root)
    spec = resolve(job, runtime)
    assert record_failure(job, RuntimeError("boom"), runtime) is False
    assert counts == dict.fromkeys(COUNTED, 1)
    assert folder == f"{tmp_path}/outputs/{spec.name}" and spec.run_dir == tmp_path / "run"
    assert spec.start_path == ckpt and spec.model.max_positions == 64 and job.model.max_positions == 256  # merged into a copy
    failed = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (failed["name"], failed["group"], failed["status"]) == (spec.name, spec.group, "failed")
    start_checkpoint(ckpt, full=True)  # another checkpoint at the same path (a run went on): read again
    counts.update(dict.fromkeys(COUNTED, 0))
    resolvers._resolve_run_dir(str(tmp_path / "outputs"), _root_=root)
    assert counts["start checkpoint resolution"] == 1


def test_an_unreadable_start_checkpoint_names_the_folder_and_is_reported_by_the_run(tmp_path):
    """The folder is named without the checkpoint's model (it cannot be read); the run reports the
    checkpoint in one line, after the command line's own errors."""
    from normlab import resolvers
    from normlab.errors import UserError
    from normlab.run_spec import resolve

    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    root = hydra_cfg([f"finetune={bad}"])
    assert resolvers._resolve_run_dir("outputs", _root_=root).startswith("outputs/bible_de_en-pre_ln-xavier-none-e3d3-s1-")
    with pytest.raises(UserError, match=f"^{bad}: not a readable checkpoint"):
        resolve(hydra_cfg([f"finetune={bad}"]))
    with pytest.raises(UserError, match="^optim.lr: "):
        resolve(hydra_cfg([f"finetune={bad}", "optim.lr=-1"]))


def test_a_command_lines_own_error_is_not_blamed_on_the_start_checkpoint(tmp_path):
    """resume=/finetune= and a bad value of the command line alone: that value's own line (the config is
    validated once; only a failing merged config is checked without the checkpoint's model, to say which)."""
    from normlab.config import ConfigError
    from normlab.run_spec import resolve

    ckpt = tmp_path / "start.ckpt"
    torch.save({"model_config": {"d_model": 64, "decoder_d_model": 64}, "state_dict": {}}, ckpt)
    with pytest.raises(ConfigError, match=r"^optim\.lr: -1 is not valid"):
        resolve(hydra_cfg([f"finetune={ckpt}", "optim.lr=-1"]))
    with pytest.raises(ConfigError, match=rf"^finetune={ckpt}: the checkpoint's model and the command line's "
                                          r"model\.d_model=48 do not combine: model\.share_embeddings: "):
        resolve(hydra_cfg([f"finetune={ckpt}", "model.d_model=48"]))
    assert resolve(hydra_cfg(["model.d_model=48", f"run_dir={tmp_path}"])).model.d_model == 48  # alone: valid
