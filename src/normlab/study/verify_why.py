"""Why a rerun of a record's first steps (study/verify.py) gave other bits: what the record's steps
ran with that the rerun did not, or that the record does not name, each a line, then what is left.

fp32 training is the same to the bit for the same code, seed, settings, thread count and kernel path
(hardware.py; docs/results-and-determinism.md, "Determinism"). verify reruns at the record's
settings, thread count and (where this checkout's differ) its commit's code, and takes its kernel
path where the CPU can; what it cannot take is said here: a record that names no code or no CPU
(trained before results.json had `code` or `cpu`), a commit not in this clone or with uncommitted
changes, a kernel path this CPU does not have.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


def recorded_threads(res: dict) -> int | None:
    m = re.search(r", (\d+) threads?$", str(res.get("device") or ""))
    return int(m.group(1)) if m else None


@dataclass
class RerunCode:
    """The code the rerun runs: this checkout's (root None), or the record's commit's src/ and conf/
    exported under root, and how it is paused after the steps."""
    pause: list[str]
    commit: str | None = None  # the record's commit when the rerun runs its code
    root: Path | None = None
    by_signal: bool = False  # paused by pause_at.py (code before stop_at_step): exit 143, "preempted"
    notes: list[str] = field(default_factory=list)


def record_legs(res: dict, steps: int) -> list[dict]:
    """The legs of the record's code (provenance.code_legs) that trained some of its first `steps`
    steps, each with `n`, how many; a record from before code_legs: its code (its last leg's, or
    none) from step 0."""
    legs = res.get("code_legs") if isinstance(res.get("code_legs"), list) else None
    legs = sorted(legs or [{"from_step": 0, **(res.get("code") or {"commit": None})}],
                  key=lambda g: int(g.get("from_step") or 0))
    ends = [int(g.get("from_step") or 0) for g in legs[1:]] + [steps]
    return [{**g, "n": min(end, steps) - int(g.get("from_step") or 0)}
            for g, end in zip(legs, ends) if int(g.get("from_step") or 0) < steps]


def reasons(res: dict, mine: dict, steps: int, record: Path | None = None, code: RerunCode | None = None) -> list[str]:
    """The record's first `steps` steps against the rerun's (`mine`: its results.json), one line a
    cause: settings, code, kernel path, threads, device."""
    code = code or RerunCode([])
    out = []
    # a rerun paused by pause_at.py has one callback more in its config: its identity is not the
    # record's by construction, and at the record's own code the overrides compose to its config
    if not code.by_signal and res.get("identity_hash") and mine.get("identity_hash") \
            and res["identity_hash"] != mine["identity_hash"]:
        out.append(f"settings: the record's overrides compose to another run here (identity {mine['identity_hash']}, "
                   f"recorded {res['identity_hash']}): conf/ or a default changed since")
    out += code_reasons(res, mine.get("code") or {}, steps, record, code)
    out += kernel_reasons(res, mine)
    theirs_t, ours_t = recorded_threads(res), recorded_threads(mine)
    if theirs_t is None:
        out.append(f"threads: the record names none (its device: {res.get('device') or 'not recorded'}); "
                   f"this rerun: {ours_t}")
    elif theirs_t != ours_t:
        out.append(f"threads: record {theirs_t}, rerun {ours_t}")
    if _kind(res) and _kind(mine) and _kind(res) != _kind(mine):
        out.append(f"device: the record trained on {_kind(res)} ({res.get('device')}), the rerun on {_kind(mine)}")
    return out


def _kind(r: dict) -> str:
    return str(r.get("device") or "").partition(":")[0]


def code_reasons(res: dict, here: dict, steps: int, record: Path | None, code: RerunCode) -> list[str]:
    """The record's code for its first `steps` steps (every leg that trained some of them) against
    the rerun's: the commit it ran (`code`), whether src/ and conf/ differ, uncommitted changes, torch."""
    from normlab.provenance import changed_since, code_differs, first_committed

    legs = record_legs(res, steps)
    out = []
    last_only = not isinstance(res.get("code_legs"), list) and bool((res.get("code") or {}).get("commit"))
    if last_only:
        out.append("code: the record names its last leg's code only (trained before results.json had code_legs): "
                   "taken for its first steps")
    for leg in legs:
        commit, since = leg.get("commit"), f" (steps from {leg.get('from_step')})" if len(legs) > 1 else ""
        if not commit:
            added = first_committed(record / "results.json") if record is not None else None
            out.append(f"code: the record names none{since}: trained before its code was recorded, so there is "
                       "no commit to rerun it at" + (f" (the record was first committed in {added}: its code is "
                                                     "that commit's or older)" if added else ""))
            continue
        if code.commit is not None:  # rerun at the record's commit (verify.rerun_code)
            differ = [] if commit == code.commit else code_differs(code.commit, commit)
            if differ == []:
                out.append(f"code: rerun at the record's commit {commit[:8]}{since}"
                           + (" (its last leg's)" if last_only else ": not a cause"))
            else:
                out.append(f"code: the record's steps{since} ran {commit[:8]}, the rerun {code.commit[:8]} (the code of "
                           f"most of the steps): " + (f"{len(differ)} file(s) under src/ and conf/ differ"
                                                      if differ else "git cannot compare them"))
        else:
            changed = changed_since(commit)
            if changed is None:
                out.append(f"code: the record's commit {commit[:8]}{since} is not in this clone: rerun at this "
                           f"checkout's code ({str(here.get('commit'))[:8]})")
            elif changed:
                out.append(f"code: the record's commit is {commit[:8]}{since}, this rerun's {str(here.get('commit'))[:8]}"
                           f"{' with uncommitted changes' if here.get('dirty') else ''}: {len(changed)} file(s) under "
                           f"src/ and conf/ differ ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})")
            else:
                out.append(f"code: src/ and conf/ are the record's commit {commit[:8]}'s{since}: not a cause")
        if leg.get("dirty"):
            out.append(f"code: the record's commit {commit[:8]} had uncommitted changes in src/ or conf/ "
                       "(not reproducible from the commit alone)")
    theirs_torch = (res.get("code") or {}).get("torch")
    if theirs_torch and here.get("torch") and theirs_torch != here["torch"]:
        out.append(f"torch: the record's {theirs_torch}, this rerun's {here['torch']}")
    return out


def kernel_reasons(res: dict, mine: dict) -> list[str]:
    """The record's CPU and kernel path against the rerun's (a rerun at code from before results.json
    had `cpu`: this machine's, as this process reads it)."""
    from normlab.hardware import cpu_info, cpu_text

    theirs, ours = res.get("cpu"), mine.get("cpu") or cpu_info()
    if not isinstance(theirs, dict):
        return [f"kernel path: the record names none (trained before results.json had `cpu`; its device: "
                f"{res.get('device') or 'not recorded'}); this rerun's: {cpu_text(ours)}. On another CPU "
                "or kernel path fp32 sums round otherwise"]
    if any(theirs.get(k) != ours.get(k) for k in ("model", "isa", "capability", "mkl", "onednn")):
        return [f"kernel path: the record's {cpu_text(theirs)} ({theirs.get('isa')}; MKL {theirs.get('mkl')}; "
                f"oneDNN {theirs.get('onednn')}), this rerun's {cpu_text(ours)} ({ours.get('isa')}; MKL "
                f"{ours.get('mkl')}; oneDNN {ours.get('onednn')})"]
    return [f"kernel path: the record's ({cpu_text(ours)}): not a cause"]


def conclusion(res: dict, mine: dict, steps: int, code: RerunCode) -> str:
    """One line: what the rerun could not take from the record (so the bits may differ), or that
    nothing the record names differs."""
    from normlab.hardware import cpu_info
    from normlab.provenance import changed_since, code_differs

    legs, left = record_legs(res, steps), []
    if not code.by_signal and res.get("identity_hash") and mine.get("identity_hash") \
            and res["identity_hash"] != mine["identity_hash"]:
        left.append("its settings (conf/ or a default changed)")
    if not all(g.get("commit") for g in legs):
        left.append("the code it trained at (not recorded)")
    elif code.commit is None and any(changed_since(g["commit"]) is None for g in legs):
        left.append("its commit (not in this clone)")
    elif code.commit is None and not any(g.get("dirty") for g in legs) and any(changed_since(g["commit"]) for g in legs):
        left.append("its code (git could not export it)")  # (a dirty commit is rerun here: verify.rerun_code)
    elif code.commit is not None and any(g["commit"] != code.commit and code_differs(code.commit, g["commit"]) != []
                                         for g in legs):
        left.append("the code of its steps trained at another commit")
    if any(g.get("dirty") for g in legs):
        left.append("its uncommitted changes")
    theirs, ours = res.get("cpu"), mine.get("cpu") or cpu_info()
    if not isinstance(theirs, dict):
        left.append("its kernel path (not recorded)")
    elif any(theirs.get(k) != ours.get(k) for k in ("model", "isa", "capability", "mkl", "onednn")):
        left.append("its CPU's kernel path")
    if recorded_threads(res) is None:
        left.append("its thread count (not recorded)")
    if left:
        return f"so: not reproducible to the bit here: the rerun lacks {'; '.join(left)}"
    return ("so: nothing the record names differs (settings, code, threads, kernel path): a cause it does not "
            "record (another build of torch or of its libraries, a nondeterministic kernel)")
