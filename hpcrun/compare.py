"""Comparison tables over results, and the regression check against recorded references."""

from __future__ import annotations

import typing as tp
from pathlib import Path

import pydantic

from hpcrun.errors import HpcrunError
from hpcrun.loader import Frozen, read_yaml, validate

if tp.TYPE_CHECKING:
    import pandas as pd

METRICS = {
    "tokens_per_s": "mean",
    "tokens_per_s_per_gpu": "mean",
    "mfu": "mean",
    "step_time_p50_s": "median",
    "peak_memory_bytes": "max",
    "run_id": "count",
}


def compare(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Completed runs grouped by `keys`: throughput, MFU, step time and memory, and with
    `nodes` among the keys the scaling efficiency per GPU against the smallest node count of
    the same group."""
    unknown = [k for k in keys if k not in df.columns]
    if unknown:
        raise HpcrunError(f"unknown column(s) {', '.join(unknown)}", field="--compare")
    done = df[df["status"] == "completed"]
    table = done.groupby(keys, dropna=False).agg(METRICS).rename(columns={"run_id": "runs"}).reset_index()
    if "nodes" in keys and len(table):
        others = [k for k in keys if k != "nodes"]
        base = table.loc[table.groupby(others, dropna=False)["nodes"].idxmin()] if others else table.loc[[table["nodes"].idxmin()]]
        ref = base.set_index(others)["tokens_per_s_per_gpu"] if others else None
        if ref is None:
            table["scaling_efficiency"] = table["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"].iloc[0]
        else:
            table["scaling_efficiency"] = [
                row["tokens_per_s_per_gpu"] / ref.loc[tuple(row[k] for k in others) if len(others) > 1 else row[others[0]]]
                for _, row in table.iterrows()
            ]
    return table.sort_values(keys).reset_index(drop=True)


class Reference(Frozen):
    """One recorded reference: rows matching `match` must keep `metric` within `tolerance`."""

    match: dict[str, tp.Any] = pydantic.Field(min_length=1)
    metric: str
    value: float
    tolerance: float = pydantic.Field(default=0.1, ge=0, lt=1)
    higher_is_better: bool = True


class Baseline(Frozen):
    references: list[Reference] = pydantic.Field(min_length=1)


def load_baseline(path: Path) -> Baseline:
    return validate(Baseline, read_yaml(path), path)


def check(df: pd.DataFrame, baseline: Baseline, path: Path) -> list[tuple[str, bool]]:
    """(line, ok) per reference: the mean of the newest matching completed runs' metric against
    the reference, allowed `tolerance` (relative) in the bad direction."""
    results = []
    done = df[df["status"] == "completed"]
    for i, ref in enumerate(baseline.references):
        if ref.metric not in df.columns:
            raise HpcrunError(f"unknown metric {ref.metric!r}", path, f"references.{i}.metric")
        rows = done
        for column, value in ref.match.items():
            if column not in df.columns:
                raise HpcrunError(f"unknown column {column!r}", path, f"references.{i}.match")
            rows = rows[rows[column] == value]
        label = ", ".join(f"{k}={v}" for k, v in ref.match.items())
        if rows.empty:
            results.append((f"MISSING {label}: no completed run to compare", False))
            continue
        got = float(rows[ref.metric].astype(float).mean())
        limit = ref.value * (1 - ref.tolerance) if ref.higher_is_better else ref.value * (1 + ref.tolerance)
        ok = got >= limit if ref.higher_is_better else got <= limit
        word = "ok  " if ok else "REGRESSION"
        results.append((f"{word} {label}: {ref.metric} {got:.4g} vs reference {ref.value:.4g} (limit {limit:.4g})", ok))
    return results
