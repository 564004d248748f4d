"""Noise bands: is a difference between runs larger than the run-to-run noise?

The numbers only; people decide (docs/noise.md states the method):

- a group (K seeds of one experiment, trainlab.repeats): per metric the mean, the
  sample standard deviation (n - 1) and n;
- two groups: the difference of the means (other minus reference) with its 95%
  Welch t interval (unequal variances, Welch-Satterthwaite degrees of freedom);
- a single run against a group: the run minus the group's mean, with the 95%
  prediction interval of one more seed of the group (s * sqrt(1 + 1/n), n - 1
  degrees of freedom);
- two single runs: the difference with the interval from the noise band of a
  recorded group of the same experiment (trainlab.repeats.experiment_key), s *
  sqrt(2) on n - 1 degrees of freedom, and which group gave it; with none, the
  noise is unknown and no verdict is given.

The verdict says whether the interval holds 0: `within noise`, else `larger than
noise`. Fewer than 2 seeds: no standard deviation, `noise unknown`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

METRICS = ("val_loss", "best_val_loss", "final_loss")
CONFIDENCE = 0.95
WITHIN, LARGER, UNKNOWN = "within noise", "larger than noise", "noise unknown"


def _t(df: float) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.5 + CONFIDENCE / 2, df))


def band(values: Iterable[float | None]) -> dict[str, Any]:
    """{"mean", "std", "n"} of the values given (None left out); std needs n >= 2."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    return {
        "mean": statistics.fmean(xs) if xs else None,
        "std": statistics.stdev(xs) if len(xs) >= 2 else None,
        "n": len(xs),
    }


def _result(diff: float, half: float | None, df: float | None, method: str) -> dict[str, Any]:
    if half is None or not math.isfinite(half):
        return {
            "difference": diff,
            "interval": None,
            "df": df,
            "verdict": UNKNOWN,
            "method": method,
        }
    lo, hi = diff - half, diff + half
    return {
        "difference": diff,
        "interval": [lo, hi],
        "df": df,
        "verdict": WITHIN if lo <= 0 <= hi else LARGER,
        "method": method,
    }


def welch(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Group b minus group a (bands), Welch's t interval."""
    if a["mean"] is None or b["mean"] is None:
        return _result(math.nan, None, None, "welch")
    diff = b["mean"] - a["mean"]
    if a["std"] is None or b["std"] is None:
        return _result(diff, None, None, "welch")
    va, vb = a["std"] ** 2 / a["n"], b["std"] ** 2 / b["n"]
    se2 = va + vb
    if se2 == 0:
        return _result(diff, 0.0, math.inf, "welch")
    df = se2**2 / (va**2 / (a["n"] - 1) + vb**2 / (b["n"] - 1))
    return _result(diff, _t(df) * math.sqrt(se2), df, "welch")


def run_vs_group(x: float | None, group: dict[str, Any], sign: int = 1) -> dict[str, Any]:
    """A single run's value against a group's band: sign * (x - mean), with the
    prediction interval of one more seed of the group."""
    if x is None or group["mean"] is None:
        return _result(math.nan, None, None, "prediction")
    diff = sign * (x - group["mean"])
    if group["std"] is None:
        return _result(diff, None, None, "prediction")
    n = group["n"]
    return _result(diff, _t(n - 1) * group["std"] * math.sqrt(1 + 1 / n), n - 1, "prediction")


def runs_with_band(
    a: float | None, b: float | None, noise: dict[str, Any] | None
) -> dict[str, Any]:
    """b minus a for two single runs, with a recorded group's band as the noise."""
    if a is None or b is None:
        return _result(math.nan, None, None, "recorded band")
    if not noise or noise["std"] is None:
        return _result(b - a, None, None, "recorded band")
    n = noise["n"]
    return _result(b - a, _t(n - 1) * noise["std"] * math.sqrt(2), n - 1, "recorded band")


# --------------------------------------------------------------------------- rows


def units(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as units to compare, in order of first appearance: a group (every
    row with its group_id) or a single run."""
    out: list[dict[str, Any]] = []
    index: dict[str, dict[str, Any]] = {}
    for row in rows:
        gid = row.get("group_id")
        if gid and gid in index:
            index[gid]["rows"].append(row)
            continue
        unit = {"group_id": gid, "rows": [row]}
        if gid:
            index[gid] = unit
        out.append(unit)
    return out


def group_summary(unit: dict[str, Any]) -> dict[str, Any]:
    rows = unit["rows"]
    return {
        "group_id": unit["group_id"],
        "name": rows[0].get("params", {}).get("name") or rows[0]["name"],
        "experiment_key": rows[0].get("experiment_key"),
        "n": len(rows),
        "runs": [r["name"] for r in rows],
        "metrics": {m: band(r.get(m) for r in rows) for m in METRICS},
    }


def _label(unit: dict[str, Any]) -> str:
    return f"group {unit['group_id']}" if unit["group_id"] else unit["rows"][0]["name"]


def compare_units(
    a: dict[str, Any], b: dict[str, Any], recorded: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """b against a, per metric. `recorded`: groups of the store by experiment key
    ({key: group_summary}), the noise band for two single runs."""
    out: dict[str, Any] = {"a": _label(a), "b": _label(b), "metrics": {}}
    if a["group_id"] and b["group_id"]:
        ga, gb = group_summary(a), group_summary(b)
        out["metrics"] = {m: welch(ga["metrics"][m], gb["metrics"][m]) for m in METRICS}
        return out
    if a["group_id"] or b["group_id"]:
        group, single, sign = (a, b, 1) if a["group_id"] else (b, a, -1)
        g, row = group_summary(group), single["rows"][0]
        out["metrics"] = {m: run_vs_group(row.get(m), g["metrics"][m], sign) for m in METRICS}
        return out
    ra, rb = a["rows"][0], b["rows"][0]
    source = recorded.get(ra.get("experiment_key")) or recorded.get(rb.get("experiment_key"))
    out["noise_from"] = source["group_id"] if source else None
    out["metrics"] = {
        m: runs_with_band(ra.get(m), rb.get(m), source["metrics"][m] if source else None)
        for m in METRICS
    }
    return out


def noise_report(
    rows: Sequence[dict[str, Any]], recorded: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """{"groups": [...], "comparisons": [...]} for compare's rows (newest first):
    every group's bands, and every other unit against the reference, the oldest
    (the baseline a change is measured against): difference = other - reference."""
    us = units(list(rows)[::-1])
    groups = [group_summary(u) for u in us if u["group_id"]]
    comparisons = [compare_units(us[0], u, recorded or {}) for u in us[1:]]
    return {"groups": groups, "comparisons": comparisons}
