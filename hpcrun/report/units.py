"""Numbers as people read them in a report: GB, k tokens/s, %, ms; a dash where nothing was
measured (never `<NA>` or `nan`)."""

from __future__ import annotations

import math
import typing as tp

DASH = "–"


def missing(value: tp.Any) -> bool:
    if value is None:
        return True
    try:
        import pandas as pd

        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _number(value: tp.Any) -> float | None:
    if missing(value):
        return None
    number = float(value)
    return None if math.isnan(number) else number


def gigabytes(value: tp.Any) -> str:
    n = _number(value)
    return DASH if n is None else f"{n / 1e9:.2f} GB"


def kilo(value: tp.Any) -> str:
    """Token rates: 12.3 k (tokens/s)."""
    n = _number(value)
    return DASH if n is None else f"{n / 1e3:.3g} k"


def percent(value: tp.Any, digits: int = 1) -> str:
    n = _number(value)
    return DASH if n is None else f"{100 * n:.{digits}f} %"


def share(value: tp.Any) -> str:
    """A small share of time, such as the wall time lost to saves (budget: ~1%): 0.53 %."""
    return percent(value, 2)


def milliseconds(value: tp.Any) -> str:
    n = _number(value)
    return DASH if n is None else f"{1e3 * n:.3g} ms"


def plain(value: tp.Any, fmt: str = "{:.4g}") -> str:
    if missing(value):
        return DASH
    if isinstance(value, float):
        return fmt.format(value)
    return str(value)
