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
    "wall_tokens_per_s": "mean",  # beside tokens_per_s: what the wall clock saw, saves and snapshots included
    "recovery_overhead": "mean",
    "tokens_per_s_per_gpu": "mean",
    "mfu": "mean",
    "step_time_p50_s": "median",
    "peak_memory_bytes": "max",
    "run_id": "count",
}


# what makes two runs' numbers different measurements: a group averaging over any of these says so
# what the runs a group averages must share, else `mixes` names it: a shrunk attempt (a lost node, README
# "Training on through a lost node") trains a larger world's global batch on fewer nodes
MEASURES = ["model", "micro_batch", "seq_len", "precision", "world_size", "global_batch"]


def compare(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Completed runs grouped by `keys`: throughput (per step and by the wall clock, and the share
    of wall time lost to saves and snapshots), MFU, step time and memory, and with `nodes` among
    the keys the scaling efficiency per GPU against the smallest node count of the same group.
    `strategy` groups by the label the report uses (`zero2`, `zero3+nvme`), and `mixes` names
    what the runs of a group differ in among MEASURES (empty when nothing)."""
    unknown = [k for k in keys if k not in df.columns]
    if unknown:
        raise HpcrunError(f"unknown column(s) {', '.join(unknown)}", field="--compare")
    done = df[df["status"] == "completed"].copy()
    if "strategy" in keys:
        done["strategy"] = strategy_label(done)
    measures = [m for m in MEASURES if m not in keys and m in done.columns]
    aggregations = {**METRICS, **{m: lambda values: values.nunique(dropna=False) > 1 for m in measures}}
    table = done.groupby(keys, dropna=False).agg(aggregations).rename(columns={"run_id": "runs"}).reset_index()
    table["mixes"] = [", ".join(m for m in measures if row[m]) for _, row in table.iterrows()] if len(table) else []
    table = table.drop(columns=measures)
    if "nodes" in keys and len(table):
        others = [k for k in keys if k != "nodes"]
        base = (
            table.loc[table.groupby(others, dropna=False)["nodes"].idxmin()]
            if others
            else table.loc[[table["nodes"].idxmin()]]
        )
        ref = base.set_index(others)["tokens_per_s_per_gpu"] if others else None
        if ref is None:
            table["scaling_efficiency"] = table["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"].iloc[0]
        else:
            table["scaling_efficiency"] = [
                row["tokens_per_s_per_gpu"]
                / ref.loc[tuple(row[k] for k in others) if len(others) > 1 else row[others[0]]]
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


# "Do the strategies agree?" ---------------------------------------------------------------
# Runs of the same model, seed, global batch and sequence length train the same mathematical
# model whatever the strategy: DDP, FSDP and ZeRO only change where the numbers live. Their loss
# curves should therefore match to within floating-point reassociation (a different reduction
# order in all-reduce versus reduce-scatter). Measured on the tiny model in fp32 on CPU (gloo)
# the strategies differ by about 1e-6 relative; a real divergence (a wrong gradient scale, a
# missed shard, a different data order) is percent-sized within a few steps. 1e-3 relative sits
# between the two with room on both sides; bf16/fp16 runs need a looser --tolerance (~1e-2).
AGREE_KEYS = ["model", "seed", "global_batch", "seq_len"]
AGREE_TOLERANCE = 1e-3
# Judged over the first AGREE_WINDOW steps only: once a model starts to memorise, reassociation's
# 1e-8 grows smoothly to percent (tiny model, 2 x 2, fp32: 1e-8 through step 700, 1e-2 at 1000),
# whereas a fault shows within a few steps. 100 is 20x "a few" and 7x short of that growth.
AGREE_WINDOW = 100


def strategy_label(df: pd.DataFrame) -> pd.Series:
    """One readable name per row's strategy setting: `ddp`, `fsdp`, `zero2`, `zero3+cpu`."""
    import pandas as pd

    def one(row: pd.Series) -> str:
        name = str(row.get("strategy"))
        stage = row.get("zero_stage")
        if name == "deepspeed" and not pd.isna(stage):
            name = f"zero{int(stage)}"
        offload = {str(row.get(k)) for k in ("offload_optimizer", "offload_param")} - {"none", "None", "<NA>", "nan"}
        return name + "".join(f"+{o}" for o in sorted(offload))

    return df.apply(one, axis=1).astype("string") if len(df) else pd.Series([], dtype="string")


def agreement(
    summary: pd.DataFrame, steps: pd.DataFrame, tolerance: float = AGREE_TOLERANCE, window: int = AGREE_WINDOW
) -> pd.DataFrame:
    """For each group of completed runs that trained the same model (AGREE_KEYS present in
    `summary`) with at least two strategies, over the steps all of its runs logged.

    Judged over a window: the common steps before the first common step plus `window`, counted
    in training steps, not logged rows (`common_steps` of them, the last `judged_through`). There:
    the largest loss difference between any two runs, absolute and relative (to the larger |loss|),
    the step and strategies where it occurs, and `agree` (relative difference <= tolerance). A
    group without common steps is listed with `agree` missing: nothing to compare is not a pass.

    After the window, shown and not judged: `later_steps` common steps, the largest relative
    difference among them (`drift_rel_diff`, at `drift_step`), and `exceeds_step`, the first
    common step of all whose relative difference is over the tolerance (missing if none)."""
    import numpy as np
    import pandas as pd

    if window < 1:
        raise ValueError(f"window must be at least one step, not {window}")
    # whole numbers that may be missing: Int64, so that the page shows step 2243, not 2243.0 or 2.243e+03
    counts = ["runs", "window", "common_steps", "judged_through", "worst_step", "later_steps"]
    counts += ["drift_step", "exceeds_step"]
    columns = [
        *AGREE_KEYS,
        "strategies",
        "runs",
        "common_steps",
        "max_abs_diff",
        "max_rel_diff",
        "worst_step",
        "worst_pair",
        "tolerance",
        "agree",
        "window",
        "judged_through",
        "later_steps",
        "drift_rel_diff",
        "drift_step",
        "exceeds_step",
    ]
    keys = [k for k in AGREE_KEYS if k in summary.columns]
    done = summary[summary["status"] == "completed"].copy()
    if done.empty or steps.empty:
        return pd.DataFrame(columns=columns).astype({c: "Int64" for c in counts})
    done["label"] = strategy_label(done)
    runs = done.drop_duplicates("run_id").set_index("run_id")
    curves = steps[steps["run_id"].isin(runs.index)].dropna(subset=["loss"])
    curves = curves.sort_values(["run_id", "step", "attempt"]).drop_duplicates(["run_id", "step"], keep="last")
    table = curves.pivot(index="step", columns="run_id", values="loss").astype(float)
    out = []
    for key, group in runs.groupby(keys, dropna=False):
        members = [r for r in group.index if r in table.columns]
        labels = sorted(set(group.loc[members, "label"]))
        if len(labels) < 2:
            continue
        common = table[members].dropna()
        row: dict[str, tp.Any] = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row.update(strategies=", ".join(labels), runs=len(members), tolerance=tolerance, window=window)
        if common.empty:
            out.append({**row, "common_steps": 0, "later_steps": 0, "agree": None})
            continue
        values = common.to_numpy()
        at = common.index.to_numpy().astype(int)
        high, low = values.argmax(axis=1), values.argmin(axis=1)
        spread = values.max(axis=1) - values.min(axis=1)
        scale = np.abs(values).max(axis=1)
        relative = np.divide(spread, scale, out=np.zeros_like(spread), where=scale != 0)
        judged = at < at[0] + window
        worst = int(relative[judged].argmax())  # the first of equals: the window is the array's head
        pair = (
            sorted({group.loc[members[high[worst]], "label"], group.loc[members[low[worst]], "label"]})
            if spread[worst]
            else ["none (identical losses)"]
        )
        later = np.flatnonzero(~judged)
        drifted = int(later[relative[later].argmax()]) if len(later) else None
        over = np.flatnonzero(relative > tolerance)
        out.append(
            {
                **row,
                "common_steps": int(judged.sum()),
                "max_abs_diff": float(spread[judged].max()),
                "max_rel_diff": float(relative[worst]),
                "worst_step": int(at[worst]),
                "worst_pair": " vs ".join(pair),
                "agree": bool(relative[worst] <= tolerance),
                "judged_through": int(at[judged][-1]),
                "later_steps": len(later),
                "drift_rel_diff": None if drifted is None else float(relative[drifted]),
                "drift_step": None if drifted is None else int(at[drifted]),
                "exceeds_step": int(at[over[0]]) if len(over) else None,
            }
        )
    return pd.DataFrame(out, columns=columns).astype({c: "Int64" for c in counts})
