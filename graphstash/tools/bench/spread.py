"""The spread of a benchmark's samples, written beside every median it reports.

Example::

    s = spread([1.0, 1.2, 1.1, 3.0])
    s["median"], s["min"], s["q1"], s["q3"], s["max"], s["n"]   # 1.15, 1.0, 1.075, 1.65, 3.0, 4
    figures = {"step_ms": s["median"], "step_ms_spread": s}
"""
from __future__ import annotations

import statistics


def spread(samples) -> dict:
    """``{"median", "min", "q1", "q3", "max", "n"}`` of ``samples`` (numbers, at least one);
    the quartiles interpolate as ``statistics.quantiles(method="inclusive")`` does (one
    sample: every figure is that sample)."""
    values = sorted(float(v) for v in samples)
    if not values:
        raise ValueError("samples: expected at least one, got none")
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "min": values[0], "q1": q1, "q3": q3,
            "max": values[-1], "n": len(values)}


def range_text(s: dict | None, spec: str = ".2f") -> str | None:
    """``"min-max"`` of a :func:`spread` for a table cell (None stays None)."""
    if s is None:
        return None
    return f"{format(s['min'], spec)}-{format(s['max'], spec)}"
