"""How an arm fared across its learning-rate screen, for the outcome claims (issue 35 item 4).

The papers' "post-LN fails at depth" means it fails at the regimes its authors tried, not at one
learning rate we picked. A screened study has each arm's screen (study/screen_run.py writes
<out>/screen/<arm>.json: every setting's validation loss at each rung and how it ended), so:
- fails: held when the arm diverged or stalled at every setting of its screen (then no setting is
  chosen and no seed runs), judged on its seeds as before otherwise, with the screen shown;
- "X trains where F fails" (a trains claim with `where_fails: F`): on the settings of the grid at
  which F diverged or stalled, X reaches a lower validation loss at the first rung than F (which has
  none there, or stayed at the floor). If F trained at every setting the part is untested and said so.
A setting failed when its run diverged or stalled before the first rung or logged no finite value
there (screen.rung_value).
"""
from __future__ import annotations

from pathlib import Path

from normlab.outcome import FAILED_TO_TRAIN
from normlab.study.screen import read_choice


def load_screens(study, out: Path) -> dict[str, dict]:
    """{arm: its screen's record (screen.write_choice's JSON, decided or not)} for every screened arm
    that has one on today's grid."""
    import json

    if study.screen is None:
        return {}
    found = {}
    for arm in study.arms.values():
        path = out / "screen" / f"{arm.name}.json"
        data = read_choice(path)
        if data is None and path.is_file():  # every setting failed: decided, nothing chosen
            try:
                data = json.loads(path.read_text())
            except ValueError:
                data = None
        if isinstance(data, dict) and data.get("settings"):
            found[arm.name] = data
    return found


def first_values(screen: dict) -> dict[str, float | None]:
    """{setting: its value at the first rung, None where it failed there}."""
    first = str(screen["rungs"][0])
    return {row["name"]: (None if row.get("status") in FAILED_TO_TRAIN else row.get("values", {}).get(first))
            for row in screen["settings"]}


def failed_settings(screen: dict) -> list[str]:
    return [name for name, v in first_values(screen).items() if v is None]


def fails_on_screen(screen: dict | None) -> tuple[bool, str]:
    """(failed at every setting, a line on how it fared)."""
    if not screen:
        return False, ""
    failed, n = failed_settings(screen), len(screen["settings"])
    if len(failed) == n:
        return True, f"diverged or stalled at every setting of its screen ({n} of {n})"
    trained = [r["name"] for r in screen["settings"] if r["name"] not in failed]
    return False, f"its screen: diverged or stalled at {len(failed)} of {n} settings, trained at {', '.join(trained)}"


def where_fails(arm: str, screen: dict | None, other: str, other_screen: dict | None) -> tuple[str | None, str]:
    """The screen part of "arm trains where other fails": (held | contradicted | inconclusive, or None
    when it cannot be judged, and a line saying why)."""
    if not screen or not other_screen:
        return None, f"no screen of {arm if not screen else other} to judge 'where {other} fails' on"
    mine, theirs = first_values(screen), first_values(other_screen)
    where = [s for s, v in theirs.items() if v is None and s in mine]
    if not where:
        return None, f"{other} trained at every setting of its screen: 'where {other} fails' is untested here"
    wins = [s for s in where if mine[s] is not None]  # other has no value there: any value is below its floor
    verdict = "held" if len(wins) == len(where) else "contradicted" if not wins else "inconclusive"
    return verdict, (f"where {other} diverged or stalled ({', '.join(where)}), {arm} trained at "
                     f"{len(wins)} of {len(where)}" + (f" ({', '.join(wins)})" if wins and len(wins) < len(where) else ""))
