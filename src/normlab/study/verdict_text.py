"""How a verdict reads: the claims table of a study's README and the rows of the index of every
claim (experiments/README.md), both written from a verdict's claims.json entry (claims.Verdict.
as_dict), so the two say the same; an entry written before the seed-level interval still reads."""
from __future__ import annotations

import math

from normlab.study.fewer_steps import seed_text

CLAIMS_HEADER = ["| claim | source | paper | ours: A − B, 95% seed interval (decides) | "
                 "test-set check (per-run, sentences; does not decide) | verdict |", "|---|---|---|---|---|---|"]

CLAIMS_TEXT = (
    "The verdict comes from the seed-level interval (\"ours\"): the mean difference over the seeds both arms "
    "ran, ± t at the Welch–Satterthwaite df (shown) times a standard error built from the arms' seed-to-seed "
    "variances, pooled within a regime family where the study names one (the notes say which), plus the test "
    "sentences' variance for BLEU claims (`+ test sentences`; normlab/study/stats.py gives the formulas). The "
    "test-set check is the paired bootstrap over test sentences with the runs held fixed: it says whether "
    "these runs' difference survives another draw of test sentences, not whether another seed would repeat "
    "it, and never decides. `inconclusive (needs N seeds)`: N paired seeds at the same variances would decide "
    "it. `budget-bound`: a run of either arm was still improving when it stopped (no validation plateau), so "
    "the comparison is between points on learning curves. `learns, far behind`: every seed completed, but "
    "the arm ended outside the study's bar against its reference arm. LR sensitivity (Wortsman et al. 2023): the "
    "mean over a screen's learning rates of its loss, capped at ℓ0 = ln V, minus the best; one screen per arm on "
    "one seed has no seed variance, so the verdict is the margin fixed in the claim before the screens ran "
    "(held: lower by at least it; contradicted: higher by at least it; else inconclusive). Steps to a loss "
    "(fewer_steps): per paired seed, B's steps to its last validation loss over A's steps to the same loss "
    "(linear between validations; ≥: A was there by its first validation, a lower bound; `never`: A did not "
    "get there, below the margin), shown as the geometric mean with its t interval on the log speed-ups: held "
    "when the interval lies at or above the claim's margin, contradicted when below it.")

INDEX_HEADER = ["| study | claim (A vs B, metric) | source | paper | paper's effect | ours: A − B (95% interval) | "
                "interval (decides) | verdict |", "|---|---|---|---|---|---|---|---|"]


def fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def outcome_text(statuses: dict, mean, metric: str) -> str:
    """`completed 2 (test_bleu 1.36)`: a run that "trains" may still end far below its peers; the
    mean over the scored seeds shows how far (the Pace section says where it ended)."""
    text = ", ".join(f"{k} {n}" for k, n in statuses.items())
    return f"{text} ({metric} {mean:.2f})" if text and isinstance(mean, (int, float)) else text


def status_text(statuses: dict) -> str:
    return "; ".join(f"{arm}: {', '.join(f'{k} {n}' for k, n in st.items()) or 'not run'}"
                     for arm, st in statuses.items())


def bar_text(bar: dict | None) -> str:
    """`vs pre_ln: test BLEU 8.07 = 0.54 x 15.01 (bar 0.5: met); valid NLL +0.34 nats (bar 0.3: not met)`."""
    if not bar:
        return ""
    met = lambda c: "met" if c["met"] else "not met"  # noqa: E731
    parts = []
    if "test_bleu" in bar:
        b = bar["test_bleu"]
        parts.append(f"test BLEU {b['arm']:.2f} = {b['ratio']:.2f} x {b['reference']:.2f} (bar {b['bar']:g}: {met(b)})")
    if "valid_nll" in bar:
        n = bar["valid_nll"]
        parts.append(f"valid NLL {n['arm']:.2f}, {n['gap']:+.2f} nats from {n['reference']:.2f} (bar {n['bar']:g}: {met(n)})")
    return f"vs {bar['reference']}: " + ("; ".join(parts) or "no completed seed to measure against")


def interval_text(d: dict) -> str:
    ci = f"[{fmt(d['low'])}, {fmt(d['high'])}]" if d.get("low") is not None else "[no interval]"
    return f"{d['mean']:+.2f} {ci}"


def outcome_cell(c: dict, empty: str = "no runs") -> str:
    """fails / trains: how the arm's runs ended, its mean, and the trains bar where the study has one."""
    text = outcome_text((c.get("statuses") or {}).get(c["better"], {}), (c.get("means") or {}).get(c["better"]),
                        c["metric"]) or empty
    return "; ".join(filter(None, [text, bar_text(c.get("trains_bar"))]))


def sensitivity_cell(c: dict) -> str:
    """`pre_ln 0.412, pre_qk_norm 0.105 nats (A − B −0.307)`: each arm's LR sensitivity and the difference."""
    sens = c.get("lr_sensitivity") or {}
    values = {arm: (s or {}).get("value") for arm, s in sens.items()}
    if not values or any(v is None for v in values.values()):
        return "; ".join(f"{arm}: {'no screen' if s is None else 'no setting below the cap'}"
                         for arm, s in sens.items() if s is None or s.get("value") is None) or "no screens"
    a, b = values[c["better"]], values[c["than"]]
    return f"{c['better']} {a:.3f}, {c['than']} {b:.3f} nats (A − B {a - b:+.3f})"


def steps_cell(c: dict) -> str:
    """`speed-up ×2.01 [1.22, 3.31] (s1 ×2.10, s2 ×1.80, s3 ×2.20)`: the geometric mean and its interval
    (from the log speed-ups), and each seed's."""
    seeds = list(((c.get("fewer_steps") or {}).get("seeds") or {}).values())
    if not seeds:
        return status_text(c.get("statuses") or {})
    d = c.get("difference")
    head = "" if not d else f" ×{math.exp(d['mean']):.2f} " + (
        f"[{math.exp(d['low']):.2f}, {math.exp(d['high']):.2f}]" if d.get("low") is not None else "[no interval]")
    return f"speed-up{head} ({', '.join(seed_text(r) for r in seeds)})"


def ours_cell(c: dict) -> str:
    """The seed-level interval and its method; an outcome's statuses (and bar); LR sensitivities; else
    the statuses."""
    if c.get("kind") in ("fails", "trains"):
        return outcome_cell(c)
    if c.get("kind") == "lr_sensitivity":
        return sensitivity_cell(c)
    if c.get("kind") == "fewer_steps":
        return steps_cell(c)
    d = c.get("difference")
    if not d:
        return status_text(c.get("statuses") or {})
    return f"{interval_text(d)} ({d['method']})"


def check_cell(c: dict) -> str:
    ck = c.get("test_set_check")
    return f"{interval_text(ck)} ({ck['method']})" if ck else "—"


def method_cell(c: dict) -> str:
    """The index's interval column: `t, 3 seeds, df 3.2; pooled: pre_ln_like; + test sentences`."""
    if c.get("kind") in ("fails", "trains"):
        bar = c.get("trains_bar")
        return "how the runs ended" + (f"; bar vs {bar['reference']}" if bar else "")
    if c.get("kind") == "lr_sensitivity":
        seeds = sorted({s["seed"] for s in (c.get("lr_sensitivity") or {}).values() if s and s.get("seed") is not None})
        return (f"one screen each (seed {', '.join(map(str, seeds))}), " if seeds else "one screen each, ") + \
            f"margin {c.get('margin', '—')} nats: no interval"
    d = c.get("difference")
    if c.get("kind") == "fewer_steps":
        margin = f"margin ×{c.get('margin', '—')}"
        if not d or d.get("df") is None:
            return margin + (": no interval" if d else "")
        n = d.get("paired_seeds")
        return f"t on log speed-ups, {n} seed{'s' if n != 1 else ''}, df {d['df']:.1f}; {margin}"
    if not d:
        return "—"
    n = d.get("paired_seeds")
    seeds = f", {n} seed{'s' if n != 1 else ''}" if n else ""
    if d.get("df") is None:  # an entry from before the seed-level interval, or a variance not measured
        return d["method"].split(" over")[0] + seeds + (" (judged before the seed-level interval)" if "df" not in d else "")
    families = sorted({v["source"][7:] for v in (c.get("variance") or {}).values()
                       if str(v.get("source", "")).startswith("family:")})
    return (f"t{seeds}, df {d['df']:.1f}" + (f"; pooled: {', '.join(families)}" if families else "")
            + ("; + test sentences" if "+ test sentences" in d["method"] else ""))


def who(c: dict) -> str:
    return f"{c['better']} vs {c['than']}" if c.get("than") else c["better"]


def claim_cell(c: dict) -> str:
    """The claim, its arms and metric, and where the paper showed it when not on translation."""
    metric = "LR sensitivity" if c.get("kind") == "lr_sensitivity" else c["metric"]
    metric = f"steps to {c['than']}'s last {metric}" if c.get("kind") == "fewer_steps" else metric
    return (f"{c['claim']} ({who(c)}, {metric})"
            + (f" [carried from {c['carried_from']} to MT]" if c.get("carried_from") else ""))


def verdict_word(c: dict) -> str:
    """The verdict, and the one it had under its definition before it changed after the data."""
    ch = c.get("changed_after_data")
    return f"**{c['verdict']}**" + (f" (changed after the data; was {ch['verdict_then'] or '—'})" if ch else "")


def claims_lines(claims: list[dict]) -> list[str]:
    """A study README's claims table, the text that says which interval decides, and the notes."""
    rows = [f"| {claim_cell(c)} | {c['source']} | {c['paper']}"
            + (f" (effect: {c['paper_effect']})" if c.get("paper_effect") else "")
            + f" | {ours_cell(c)} | {check_cell(c)} | {verdict_word(c)} |" for c in claims]
    notes = [f"- {c['id']}: {c['note']}" for c in claims if c.get("note")]
    return [*CLAIMS_HEADER, *rows, "", CLAIMS_TEXT, "", *notes, *([""] if notes else [])]


def index_row(study: str, folder: str, c: dict) -> str:
    ours = interval_text(c["difference"]) if c.get("difference") and c.get("kind") != "fewer_steps" else (
        f"{c['better']}: {outcome_cell(c, 'not run')}" if c.get("kind") in ("fails", "trains") else ours_cell(c))
    return (f"| [{study}]({folder}/) | {claim_cell(c)} | {c['source']} | {c['paper']} | "
            f"{c.get('paper_effect') or '—'} | {ours} | {method_cell(c)} | {verdict_word(c)} |")
