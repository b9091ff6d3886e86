"""A `fewer_steps` claim's definition, checked when the study file is read (study/spec.py): apart from
its judging (study/fewer_steps.py), which reads curves and seed variances, so that reading a study file
imports neither."""
from __future__ import annotations

from dataclasses import replace

from normlab.errors import UserError

CURVES = ("valid_loss", "valid_nll", "valid_ppl")  # the validation series metrics.csv logs (lower is better)
KEYS_REFUSED = ("than_metric", "direction")


def check_claim(c, at: str, node: dict):
    """The claim, checked (margin > 1 and given, a validation curve, the t interval) and with its
    defaults set (metric valid_loss, interval t)."""
    if "margin" not in node:
        raise UserError(f"{at}.margin", "missing: a fewer_steps claim states its speed-up factor (> 1) before the data")
    if isinstance(c.margin, bool) or not isinstance(c.margin, (int, float)) or not c.margin > 1:
        raise UserError(f"{at}.margin", f"{c.margin!r}: a fewer_steps claim needs a speed-up factor > 1 (e.g. 1.5)")
    for key in KEYS_REFUSED:
        if node.get(key) is not None:
            raise UserError(f"{at}.{key}", "not for a fewer_steps claim (one lower-is-better curve of both arms)")
    metric = node.get("metric", "valid_loss")
    if metric not in CURVES:
        raise UserError(f"{at}.metric", f"{metric!r}: a fewer_steps claim reads a validation curve", CURVES)
    if node.get("interval", "t") != "t":
        raise UserError(f"{at}.interval", f"{node['interval']!r}: a fewer_steps claim is judged on the seeds' t "
                        "interval", ["t"])
    return replace(c, metric=metric, interval="t")
