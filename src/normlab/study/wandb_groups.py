"""A study's runs in W&B: the group each was trained in, which stays its group (W&B cannot regroup a
run), and the README / index line for a study whose runs are outside its own group (a renamed study's
runs from before the rename are in its former name's group: spec.py `formerly:`)."""
from __future__ import annotations

from normlab.identity import STUDY_GROUP_PREFIX, study_group
from normlab.study.records import Record
from normlab.study.spec import available


def groups(recs: list[Record]) -> dict[str, int]:
    """{W&B group: its records}: the group each run was trained in (results.json `group`), which stays
    its group (W&B cannot regroup a run); a renamed study's runs from before the rename are in its
    former name's group."""
    counts: dict[str, int] = {}
    for r in recs:
        if isinstance(r.results.get("group"), str):
            counts[r.results["group"]] = counts.get(r.results["group"], 0) + 1
    return dict(sorted(counts.items()))


def group_text(name: str, budget: str, counts: dict[str, int], formerly=()) -> str:
    """Where a study's runs are in W&B, when any is outside its own group (study_group): each group, its
    runs and why (trained under the study's former name, a name another study now has; trained as
    another study), and where its new runs go. "" when every record is in its own group."""
    own = study_group(name, budget)
    suffix = own.removeprefix(study_group(name))  # "-smoke" for another budget's groups, else ""
    if not counts or set(counts) == {own}:
        return ""
    current = set(available())
    parts = []
    for group, n in counts.items():
        runs = f"{n} run{'s' if n != 1 else ''}"
        other = group.removeprefix(STUDY_GROUP_PREFIX) if group.startswith(STUDY_GROUP_PREFIX) else None
        base = other.removesuffix(suffix) if other is not None and other.endswith(suffix) else None
        if group == own:
            why = ""
        elif base in formerly:  # the former name's group at this budget
            why = (f", trained under this study's former name {base}"
                   + (f"; the study {base} now runs in this group too: these are the W&B runs named as the "
                      "records' `name`" if base in current else ""))
        else:
            why = f", trained as {other}: runs it shares" if other else ""
        parts.append(f"`{group}` ({runs}{why})")
    return (f"W&B groups of its runs (the group a run trained in; W&B cannot regroup a run): {'; '.join(parts)}. "
            f"New runs of this study go to `{own}`.")
