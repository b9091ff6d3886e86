"""Claims are fixed before their data (issue 35 item 5): a study's first records fix each claim's
definition, and a definition changed afterwards is shown with the verdict it had, never silently.

A claim's definition is what decides its verdict: kind, margin, the arms (better, than), the metrics
and the direction. Its words (claim, source, paper, paper_effect) may be corrected at any time.

<out>/claims.lock.json holds, per claim id, the definition it had when the study first had records
(`fixed`), its hash, and the verdict under it the last time the README was written with that
definition (`verdict`). When the study file's definition no longer hashes the same, the README and the
index show the change: the fixed definition, the new one, the last verdict under the fixed one beside
today's, and the study file's reason (`claims[i].changed: "why"`), or "no reason given". The lock keeps
the fixed definition (the change is shown until the study file puts it back); a claim added after the
data is fixed when it first appears and marked as added after the first records.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

DEFINITION = ("kind", "margin", "better", "than", "metric", "than_metric", "direction")
MARGIN_KINDS = ("similar", "no_worse", "lr_sensitivity", "fewer_steps")  # the kinds whose verdict reads `margin`

# The verdict rules a verdict was given under: a lock entry written before they were recorded was
# judged by the first ones. A verdict that moves under an unchanged definition is kept in the entry's
# `history` with the rules it had, so the README can say whether the rules or the records moved it.
FIRST_RULES = "bootstrap"
RULES = "seed-2026-11-27"
RULES_TEXT = {
    FIRST_RULES: "the two-level bootstrap over 2-3 seeds and test sentences; 'trains' = above the unigram floor",
    RULES: "seed-level t intervals pooled per regime family, 'inconclusive (needs N seeds)', the trains bar "
           "('learns, far behind'), 'budget-bound' for an arm stopped at its cap still improving, and in a screened "
           "study the outcome claims judged on the learning-rate screens (issue 35)",
}


def definition(claim) -> dict:
    """What decides a claim's verdict (margin only where the kind reads it)."""
    d = {k: getattr(claim, k) for k in DEFINITION}
    if d["kind"] not in MARGIN_KINDS:
        d.pop("margin")
    if getattr(claim, "cap", None) is not None:  # lr_sensitivity's ℓ0 (no claim fixed before it has one)
        d["cap"] = claim.cap
    if getattr(claim, "where_fails", None):  # only where set: the claims fixed before it existed keep their hash
        d["where_fails"] = claim.where_fails
    return d


def definition_hash(claim) -> str:
    return hashlib.sha256(json.dumps(definition(claim), sort_keys=True, default=str).encode()).hexdigest()[:12]


def read_lock(out: Path) -> dict:
    try:
        data = json.loads((out / "claims.lock.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_lock(out: Path, claims, verdicts: dict[str, str], has_records: bool, today: str) -> dict[str, dict]:
    """Fix the claims of a study that has records (the first time each is seen), record the verdict
    each unchanged claim has now, and return {claim id: change} for the claims whose definition
    differs from the fixed one: {"fixed", "now", "verdict_then", "verdict_now", "why"}."""
    lock = read_lock(out)
    if not has_records and not lock:
        return {}  # nothing to fix a claim before: a study without data may still change its claims
    first = not lock
    changes = {}
    for c in claims:
        now, h = definition(c), definition_hash(c)
        entry = lock.get(c.id)
        if entry is None:
            lock[c.id] = {"fixed": now, "hash": h, "fixed_on": today, "verdict": verdicts.get(c.id), "rules": RULES,
                          **({} if first else {"added_after_data": True})}
            continue
        if entry.get("hash") == h:
            _judged(entry, verdicts.get(c.id), today)
            continue
        changes[c.id] = {"fixed": entry.get("fixed"), "now": now, "verdict_then": entry.get("verdict"),
                         "verdict_now": verdicts.get(c.id), "why": getattr(c, "changed", None) or "no reason given",
                         "fixed_on": entry.get("fixed_on")}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "claims.lock.json.tmp"
    tmp.write_text(json.dumps(lock, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(out / "claims.lock.json")
    return changes


def _judged(entry: dict, verdict: str | None, today: str) -> None:
    """Record today's verdict under the fixed definition; the one it replaces goes to the history."""
    if verdict != entry.get("verdict") and entry.get("verdict") not in (None, "not run"):  # a run landing is no move
        entry.setdefault("history", []).append({"verdict": entry.get("verdict"),
                                                "rules": entry.get("rules", FIRST_RULES), "until": today})
    entry["verdict"], entry["rules"] = verdict, RULES


def moved_lines(out: Path) -> list[str]:
    """The README's section on verdicts that moved under an unchanged definition: each claim's last
    move, and whether the verdict rules or the records moved it."""
    moves = [(cid, e["history"][-1], e.get("verdict")) for cid, e in sorted(read_lock(out).items())
             if isinstance(e, dict) and e.get("history")]
    if not moves:
        return []
    lines = ["## Verdicts that moved", "",
             "The claim's definition is the fixed one; its verdict changed when the verdict rules or the "
             "records did (claims.lock.json keeps each earlier verdict with the rules it was given under). "
             "The rules: " + "; ".join(f"**{r}**: {RULES_TEXT.get(r, r)}" for r in
                                       dict.fromkeys([*(t.get("rules") for _, t, _ in moves), RULES])) + ".", "",
             "| claim | verdict then | until | verdict now | why |", "|---|---|---|---|---|"]
    for cid, then, now in moves:
        why = (f"the rules: {then.get('rules')} → {RULES}" if then.get("rules") != RULES
               else "the records (runs added or continued)")
        lines.append(f"| {cid} | {then.get('verdict') or '—'} | {then.get('until')} | {now or '—'} | {why} |")
    return lines + [""]


def change_lines(changes: dict[str, dict]) -> list[str]:
    """The README's section on claims changed after the data."""
    if not changes:
        return []
    lines = ["## Claims changed after the data", "",
             "A claim's definition (kind, margin, arms, metric, direction) is fixed when the study first has "
             "records (claims.lock.json); these differ from it. Each shows the verdict it had under the fixed "
             "definition beside today's.", "",
             "| claim | fixed definition | now | verdict then | verdict now | why |", "|---|---|---|---|---|---|"]
    for cid, ch in changes.items():
        diff = sorted(k for k in set(ch["fixed"] or {}) | set(ch["now"]) if (ch["fixed"] or {}).get(k) != ch["now"].get(k))
        then = ", ".join(f"{k} {(ch['fixed'] or {}).get(k)}" for k in diff)
        now = ", ".join(f"{k} {ch['now'].get(k)}" for k in diff)
        lines.append(f"| {cid} | {then} | {now} | {ch['verdict_then'] or '—'} | {ch['verdict_now'] or '—'} | {ch['why']} |")
    return lines + [""]


def same_kind_across_studies(studies) -> list[str]:
    """Claims with one id in several studies must be judged the same way: the ids whose definitions'
    kind or margin differ between studies (one line each)."""
    seen: dict[str, tuple[str, tuple]] = {}
    bad = []
    for study in studies:
        for c in study.claims:
            key = (c.kind, c.margin if c.kind in MARGIN_KINDS else None)
            if c.id in seen and seen[c.id][1] != key:
                bad.append(f"{c.id}: {seen[c.id][0]} judges it as {seen[c.id][1][0]}, {study.name} as {key[0]}")
            seen.setdefault(c.id, (study.name, key))
    return bad
