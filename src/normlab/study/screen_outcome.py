"""How an arm fared across its learning-rate screen, for the outcome claims (issue 35 item 4).

The papers' "post-LN fails at depth" means it fails at the regimes its authors tried, not at one
learning rate we picked. A screened study has each arm's screen (study/screen_run.py writes
<out>/screen/<arm>.json when every rung is done: each setting's validation loss at the rungs it
reached, how its run stood, and the input-independent floor L* of its data, callbacks/stall.py), so:
- a setting failed when its run diverged or stalled, or its last value in the screen (at the last
  rung it reached) is still at the floor: above L* − FLOOR_MARGIN, the stall guard's own band. The
  guard needs window + patience steps after the warmup, so at a rung a warmup-1,000 setting or a
  late stall is not yet flagged: the value says it;
- fails: held when the arm failed at every setting of its screen (then nothing is chosen and no seed
  runs); a trains claim of such an arm is contradicted;
- "X trains where F fails" (a trains claim with `where_fails: F`): X did not fail at the settings at
  which F failed (so its final loss there is below F's, which is at the floor or none). If F failed at
  no setting the part is untested and said so.
Only a screen on today's grid counts (as screen_run.choices takes it); a row whose run left no
status (not run yet) makes the screen incomplete: nothing is judged on it.
"""
from __future__ import annotations

from pathlib import Path

from normlab.outcome import FAILED_TO_TRAIN
from normlab.study.screen import read_screen, setting_name

FLOOR_MARGIN = 0.25  # conf/callbacks/stall.yaml margin: "no better than ignoring the input"
ENDED = ("stopped", "completed", *FAILED_TO_TRAIN)


def load_screens(study, out: Path) -> dict[str, dict]:
    """{arm: its screen's record (decided, or every setting failed)} for every screened arm whose
    screen ran on today's grid."""
    if study.screen is None:
        return {}
    grid = [setting_name(s) for s in study.screen.settings()]
    found = {}
    for arm in (a for a in study.arms.values() if study.screened(a)):
        data = read_screen(out / "screen" / f"{arm.name}.json", grid)  # damaged: named once, not judged
        if data is not None:
            found[arm.name] = data
    return found


def complete(screen: dict) -> bool:
    return all(row.get("status") in ENDED for row in screen["settings"])


def last_value(row: dict) -> float | None:
    """The setting's value at the last rung it reached (None: none there)."""
    values = [v for _, v in sorted(((int(k), v) for k, v in (row.get("values") or {}).items()))]
    return values[-1] if values else None


def failed(row: dict) -> bool:
    value, floor = last_value(row), row.get("floor")
    return (row.get("status") in FAILED_TO_TRAIN or value is None
            or (floor is not None and value > floor - FLOOR_MARGIN))


def fails_on_screen(screen: dict | None) -> tuple[bool, str]:
    """(failed at every setting, a line on how it fared)."""
    if not screen:
        return False, ""
    if not complete(screen):
        return False, "its screen is not complete"
    rows = screen["settings"]
    bad = [r["name"] for r in rows if failed(r)]
    if len(bad) == len(rows):
        return True, f"diverged, stalled or at the floor at every setting of its screen ({len(rows)} of {len(rows)})"
    trained = [r["name"] for r in rows if r["name"] not in bad]
    return False, (f"its screen: diverged, stalled or at the floor at {len(bad)} of {len(rows)} settings, "
                   f"trained at {', '.join(trained)}")


def where_fails(arm: str, screen: dict | None, other: str, other_screen: dict | None) -> tuple[str | None, str]:
    """The screen part of "arm trains where other fails": (held | contradicted | inconclusive, or None
    when it cannot be judged, and a line saying why)."""
    if not screen or not other_screen:
        return None, f"no screen of {arm if not screen else other} to judge 'where {other} fails' on"
    if not complete(screen) or not complete(other_screen):
        return None, f"the screens of {arm} and {other} are not complete"
    mine = {r["name"]: r for r in screen["settings"]}
    where = [r["name"] for r in other_screen["settings"] if failed(r) and r["name"] in mine]
    if not where:
        return None, f"{other} trained at every setting of its screen: 'where {other} fails' is untested here"
    wins = [s for s in where if not failed(mine[s])]
    verdict = "held" if len(wins) == len(where) else "contradicted" if not wins else "inconclusive"
    return verdict, (f"where {other} diverged, stalled or stayed at the floor ({', '.join(where)}), {arm} "
                     f"trained at {len(wins)} of {len(where)}"
                     + (f" ({', '.join(wins)})" if wins and len(wins) < len(where) else ""))
