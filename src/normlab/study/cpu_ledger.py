"""The CPU time spent on a screen's setting (issue 36): a rung record's `cpu_spent`, what the machines
spent on the setting's run of that identity, not only what the run the record holds now used.

A rung record's `cpu_s` is its run's CPU time over all its legs (callbacks/full_checkpoint.py), and
the record is replaced at the next rung. Read alone, it loses or double-counts time in two cases:
- a setting kept at a rung on a fresh clone trains again from step 0 (its checkpoint is not
  committed): the new run's cpu_s holds none of the first machine's work to the rung, which that
  machine spent all the same (work redone, still a cost);
- a run another study recorded at a rung (copied here, `shared_from`) continued here from its
  checkpoint (one pool of run folders): its cpu_s holds the other study's steps, counted there.
So each rung record carries `cpu_spent`: [{"study": the study whose machine spent it, "cpu_s",
"redone": its run was trained again from step 0 since}], and each study counts its own entries
(screen_report.screen_cpu), so each CPU second is counted in one study. A record without the field
(written before it, or without cpu_s) stands for one entry: its cpu_s, spent by the study that
trained it (shared_from's study, else the one holding it).
"""
from __future__ import annotations

import math
from pathlib import Path


def seconds(value) -> float | None:
    """A CPU time in seconds, or None when it is not one (missing, damaged)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return float(value) if ok else None


def spent(res: dict, own: str) -> list[dict] | None:
    """The record's entries (module docstring); None when its CPU time is not known (no cpu_s)."""
    ledger = res.get("cpu_spent")
    if isinstance(ledger, list) and ledger and all(
            isinstance(e, dict) and seconds(e.get("cpu_s")) is not None for e in ledger):
        return ledger
    cpu = seconds(res.get("cpu_s"))
    if cpu is None:
        return None
    shared = res.get("shared_from")
    who = str(shared.get("study") or own) if isinstance(shared, dict) else own  # no study named: the holder's,
    # rather than a name no study claims (its seconds would drop out of every total)
    return [{"study": who, "cpu_s": cpu, "redone": False}]


def legs_continue(old: dict, new: dict) -> bool | None:
    """Whether new's run continued old's (old's code legs begin new's, and new's next leg starts at
    old's steps: provenance.code_legs); None when either has no code_legs (records from before them)."""
    mine, theirs = old.get("code_legs"), new.get("code_legs")
    if not isinstance(mine, list) or not isinstance(theirs, list):
        return None
    n = len(mine)
    return (theirs[:n] == mine and len(theirs) > n and isinstance(theirs[n], dict)
            and theirs[n].get("from_step") == old.get("steps"))


def holds(old: dict, new: dict) -> bool:
    """Whether new's run holds old's work: the same run state (the same legs and steps), or continued
    from it. Without code legs, the same identity is taken as continued (as screen_report.continued
    does), unless new used less CPU time than old, which a continued run never does."""
    cpu_new, cpu_old = seconds(new.get("cpu_s")), seconds(old.get("cpu_s"))
    if cpu_new is not None and cpu_old is not None and cpu_new < cpu_old:
        return False
    went_on = legs_continue(old, new)
    if went_on is None:
        return True
    return went_on or (new.get("code_legs") == old.get("code_legs") and new.get("steps") == old.get("steps"))


def with_ledger(new: dict, old: dict | None, own: str) -> dict:
    """A rung record's results about to be written (from its run folder) with `cpu_spent`: the
    entries of the record it replaces (`old`, when of the same identity: another identity's run is
    another experiment's cost), then what `own`'s machine spent beyond them: the run's CPU time past
    old's when it holds old's run, else all of it (old's entries then marked redone)."""
    new = {k: v for k, v in new.items() if k != "cpu_spent"}
    cpu = seconds(new.get("cpu_s"))
    if cpu is None:
        return new  # not recorded: not guessed
    same = old is not None and old.get("identity_hash") == new.get("identity_hash")
    before = spent(old, own) if same and seconds(old.get("cpu_s")) is not None else None
    if before is None:
        return {**new, "cpu_spent": [{"study": own, "cpu_s": cpu, "redone": False}]}
    if holds(old, new):
        extra = cpu - seconds(old["cpu_s"])
        return {**new, "cpu_spent": before + ([{"study": own, "cpu_s": extra, "redone": False}] if extra > 0 else [])}
    return {**new, "cpu_spent": [{**e, "redone": True} for e in before] + [{"study": own, "cpu_s": cpu,
                                                                              "redone": False}]}


def adopted(copy: dict, old: dict | None, own: str, mine: set[str]) -> dict:
    """Another study's rung record (`copy`, marked shared_from) about to replace this study's `old`
    record of the same run: this study's entries (`mine`: own_names) in old that the copy does not
    hold (work this machine spent on a run the other study then trained again itself) are kept,
    marked redone, so adopting a record never drops time this study spent."""
    theirs = spent(copy, "?")
    if old is None or theirs is None or old.get("identity_hash") != copy.get("identity_hash"):
        return copy
    left = [(e.get("study"), e.get("cpu_s")) for e in theirs]  # matched whatever was redone since
    keep = []
    for e in [e for e in spent(old, own) or [] if e.get("study") in mine]:
        if (e.get("study"), e.get("cpu_s")) in left:
            left.remove((e.get("study"), e.get("cpu_s")))  # the copy holds it: its run continued this study's
        else:
            keep.append({**e, "redone": True})
    return {**copy, "cpu_spent": theirs + keep} if keep else copy


def own_names(name: str, folder: Path, formerly: tuple[str, ...] = ()) -> set[str]:
    """The names a study's entries may carry: its name, its folder's (shared_from names a folder) and
    the names it had before a rename."""
    return {name, Path(folder).name, *formerly}
