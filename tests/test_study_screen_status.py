"""normlab-study NAME --status for a screened study (study/screen_status.py): each screened arm's
screen replayed from its run folders by the rule the study ranks with, the seeds waiting for it, the
runs of arms with a setting, and the steps and CPU-hours left; nothing run, copied or written."""
import json
import os

import pytest

from normlab.run_folder import locked
from normlab.study.screen import setting_name, write_choice
from normlab.study.screen_run import screen_jobs
from normlab.study.screen_status import replay, screened_status_lines
from normlab.study.spec import load_study

# a screened arm (4 settings, rungs 3 and 6, half kept at the first) and one at the common settings
STUDY = """title: t
paper: p
question: q
seeds: [1, 2]
arms:
  a: {overrides: [norm=prenorm]}
  b: {overrides: [norm=postnorm], screen: false}
screen:
  grid: {optim.lr: [0.001, 0.003], optim.warmup: [2, 4]}
  rungs: [3, 6]
  keep: 0.5
budgets:
  smoke:
    overrides: [trainer.max_steps=12]
claims:
  - {id: c, claim: a beats b, source: s, paper: '+1', better: a, than: b}
"""
W2, W4, H2, H4 = "lr0.001-warmup2", "lr0.001-warmup4", "lr0.003-warmup2", "lr0.003-warmup4"


def flat(line: str) -> str:
    return " ".join(line.split())  # the columns' padding aside


def fake(run_dir, status=None, steps=0, cpu_s=None, losses=None, ckpt=0, log=None):
    """A run folder as training leaves it: results.json, metrics.csv (valid/loss at optimizer steps),
    a full checkpoint, train.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if status:
        (run_dir / "results.json").write_text(json.dumps({"status": status, "steps": steps, "cpu_s": cpu_s}))
    if losses:
        (run_dir / "csv").mkdir(exist_ok=True)
        rows = "".join(f"0,{s - 1},,{v}\n" for s, v in sorted(losses.items()))
        (run_dir / "csv" / "metrics.csv").write_text("epoch,step,train/loss,valid/loss\n" + rows)
    if ckpt:
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / f"full-step{ckpt}.ckpt").write_bytes(b"")
    if log:
        (run_dir / "train.log").write_text(f"[x] {log} | loss 5.0\n")


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "st.yaml"
    path.write_text(STUDY)
    study = load_study(str(path), "smoke")  # 12 steps, a validation every 3
    runs, out = tmp_path / "runs", tmp_path / "out"
    names = [setting_name(s) for s in study.screen.settings()]
    jobs = screen_jobs(study, study.arms["a"], runs, out, names, 3)
    return study, runs, out, jobs


def test_a_screen_at_its_first_rung_and_the_seeds_that_wait_for_it(tiny):
    study, runs, out, jobs = tiny
    fake(jobs[W2].run_dir, "stopped", 3, 1800.0, {3: 5.0}, ckpt=3)  # paused at the rung
    fake(jobs[W4].run_dir, "stalled", 3, 900.0, {3: 6.5})           # out of the screen
    fake(jobs[H2].run_dir, log="step 2/12")                          # training now, no checkpoint yet
    with locked(jobs[H2].run_dir):
        lines = screened_status_lines(study, runs, out, None)
    assert lines[0] == ("st (smoke): 1 screened arms x 4 settings (optim.lr x optim.warmup, by valid_loss at steps "
                        "3, 6): 0 decided; settings: 1 at rung, 1 stalled, 1 training now, 1 not started; 4 seed "
                        "runs: 2 not started, 2 wait for their screens")
    assert lines[1] == "screen a, at rung 3: 1 at rung, 1 stalled, 1 training now, 1 not started"
    assert lines[2].split() == [W2, "at", "rung", "3:", "valid_loss", "5.000"]
    assert flat(lines[3]) == f"{W4} stalled at step 3" and flat(lines[4]) == f"{H2} training now: step 2, to rung 3"
    assert flat(lines[5]) == f"{H4} not started"
    assert flat(lines[6]) == "seeds 1, 2 wait for the screen (seed 1 continues the chosen setting's run from step 6)"
    assert flat(lines[7]) == "b seed 1 not started" and flat(lines[8]) == "b seed 2 not started"
    # steps left: the screen's rung 3 (H2: 1 of 3, as its log says 2; H4: 3), then 2 settings from 3 to
    # 6 (6), a's seed 1 from 6 to the 12-step cap and its seed 2 (6 + 12), b's two seeds (24): 52 steps,
    # at arm a's 2,700 CPU-s over 6 steps (b has none yet: a's rate) = 6.50 CPU-hours
    cores = os.cpu_count() or 1
    assert lines[9].startswith(f"left: about 6.50 CPU-hours ({6.5 / cores:.2f} hours of this machine's {cores} cores): "
                               "52 training steps (the screens to their last rung, every seed to the 12-step cap;")
    assert "(a 450.00 s; the arms not yet run at their mean, 450.00 s)" in lines[9]
    # not held: the same folder is a run that started and left no checkpoint (it starts over)
    assert flat(screened_status_lines(study, runs, out, None)[4]) == f"{H2} started, no checkpoint yet: starts over"


def test_the_replay_ranks_each_rung_as_the_study_does_and_plans_the_chosen_setting(tiny):
    study, runs, out, jobs = tiny
    fake(jobs[W2].run_dir, "stopped", 6, 600.0, {3: 5.0, 6: 4.0}, ckpt=6, log="step 6/12")
    fake(jobs[W4].run_dir, "stalled", 3, 300.0, {3: 6.5})
    fake(jobs[H2].run_dir, "stopped", 6, 600.0, {3: 4.5, 6: 4.2}, ckpt=6)
    fake(jobs[H4].run_dir, "stopped", 3, 300.0, {3: 5.5}, ckpt=3)
    r = replay(study, study.arms["a"], jobs)
    # rung 3: H2 4.5, W2 5.0 go on (the best half of 4), H4 5.5 and the stalled W4 leave; rung 6: W2 4.0
    assert [s.state for s in r.settings] == ["chosen", "left", "left", "left"] and r.left == 0
    assert r.chosen.name == W2 and r.rung is None
    lines = screened_status_lines(study, runs, out, None)
    assert lines[1] == ("screen a, every rung ranked; the choice is written when the study next runs: 1 chosen, "
                        "3 left")
    assert flat(lines[2]) == f"{W2} chosen at rung 6: valid_loss 4.000; its run is the arm's seed 1"
    assert flat(lines[3]) == f"{W4} stalled at step 3: left at rung 3"
    assert flat(lines[4]) == f"{H2} left at rung 6: valid_loss 4.200"
    assert flat(lines[5]) == f"{H4} left at rung 3: valid_loss 5.500"
    # the seeds are planned at the chosen setting; seed 1 is the chosen run, paused at step 6 of 12
    assert flat(lines[6]) == "a seed 1 stopped part-way: its step-6 checkpoint of 12; the study continues it"
    assert lines[0].endswith("; 4 seed runs: 1 stopped part-way, 3 not started")
    # a's seed 1 from its step 6 (6), its seed 2 and b's two (36), at a's 1,800 CPU-s over 18 steps (its
    # chosen run counted once, though two lines show it)
    assert "left: about 1.17 CPU-hours" in lines[-1] and " 42 training steps " in lines[-1]


def test_a_completed_setting_run_is_ranked_by_its_value_at_each_rung(tiny):
    """A setting whose run completed (a run another study trained to its end, shared) is ranked at each
    rung by the value it logged there, as screen_run ranks it, not shown as left without one."""
    study, runs, out, jobs = tiny
    fake(jobs[W2].run_dir, "completed", 12, 1200.0, {3: 4.0, 6: 3.0, 9: 2.5, 12: 2.0})
    fake(jobs[W4].run_dir, "stopped", 3, 300.0, {3: 5.0}, ckpt=3)
    fake(jobs[H2].run_dir, "stopped", 6, 600.0, {3: 4.5, 6: 3.5}, ckpt=6)
    fake(jobs[H4].run_dir, "stopped", 3, 300.0, {3: 6.0}, ckpt=3)
    r = replay(study, study.arms["a"], jobs)
    assert [s.state for s in r.settings] == ["chosen", "left", "left", "left"] and r.chosen.name == W2
    assert r.chosen.value == 3.0  # its value at the last rung (6), not at its end
    assert flat(screened_status_lines(study, runs, out, None)[2]) == (
        f"{W2} chosen at rung 6: valid_loss 3.000; its run is the arm's seed 1")


def test_a_kept_setting_waits_at_its_rung_and_a_decided_screen_is_one_line(tiny):
    study, runs, out, jobs = tiny
    fake(jobs[W2].run_dir, "stopped", 3, 300.0, {3: 5.0}, ckpt=3)
    fake(jobs[W4].run_dir, "stopped", 3, 300.0, {3: 4.0}, ckpt=3)
    fake(jobs[H2].run_dir, "diverged", 2, 200.0)
    fake(jobs[H4].run_dir, "stopped", 3, 300.0, {3: 6.0}, ckpt=3)
    lines = screened_status_lines(study, runs, out, None)
    assert lines[1] == "screen a, at rung 6: 2 kept, 2 left"
    assert flat(lines[2]) == f"{W2} kept at rung 3 (valid_loss 5.000): goes on to rung 6"
    assert flat(lines[4]) == f"{H2} diverged at step 2: left at rung 3"
    rows = [{"name": n, "overrides": [], "values": {}, "status": "stopped", "dropped_at": None} for n in jobs]
    write_choice(out / "screen" / "a.json", "a", study.screen, rows, W4)
    lines = screened_status_lines(study, runs, out, None)
    assert lines[1] == f"screen a: decided: {W4}"
    assert flat(lines[2]) == "a seed 1 stopped part-way: its step-3 checkpoint; the study continues it"
    assert lines[0].startswith("st (smoke): 1 screened arms x 4 settings (optim.lr x optim.warmup, by valid_loss at "
                               "steps 3, 6): 1 decided; 4 seed runs: 1 stopped part-way, 3 not started")


@pytest.mark.integration
def test_the_command_plans_a_screened_study_and_writes_nothing(tiny, capsys):
    from normlab.commands.study import main

    study, runs, out, jobs = tiny
    fake(jobs[W2].run_dir, "stopped", 3, 30.0, {3: 5.0}, ckpt=3)
    files = lambda: sorted((p, p.stat().st_size, p.stat().st_mtime_ns) for p in runs.parent.rglob("*"))  # noqa: E731
    before = files()
    assert main([str(study.path), "study.budget=smoke", "--status", "--out", str(out), "--runs", str(runs)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("st (smoke): 1 screened arms x 4 settings") and "0 runs planned" not in text
    assert "screen a, at rung 3: 1 at rung, 3 not started" in text and "wait for the screen" in text
    assert files() == before


def test_an_arm_whose_every_setting_failed_has_no_seed_runs_waiting_or_left(tiny):
    """The old code said its two seeds "wait for their screens" and counted their 18 steps in `left:`."""
    study, runs, out, jobs = tiny
    for name in (W2, W4, H2, H4):
        fake(jobs[name].run_dir, "stalled", 3, 900.0, {3: 8.0})
    lines = screened_status_lines(study, runs, out, None)
    assert lines[0].endswith("; 4 seed runs: 2 not started, 2 will not run (every setting of their screen failed)")
    assert lines[1] == "screen a, every rung ranked: every setting failed, no seed runs: 4 left"
    # left: b's two seeds alone (24 steps), at a's 3,600 CPU-s over 12 steps = 2.00 CPU-hours
    assert lines[-1].startswith("left: about 2.00 CPU-hours") and " 24 training steps " in lines[-1], lines[-1]
