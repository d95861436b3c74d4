"""Per-step metrics: a second Parquet dataset beside the results rows, one curve per run.

Rank 0 writes a batch of steps per file (`<results_dir>/steps/<run id>/<job id>-<attempt>-<seq>.parquet`,
made visible by an atomic rename), so nothing half-written is ever read and no writer locks.
A requeued run leaves files from several attempts; `load_steps` stitches them into one curve:
an attempt that resumed from step s replaces every row of earlier attempts from step s+1 on.
Files of other hpcrun versions load with what they have (hpcrun.tables `conform`). Nothing
compacts, moves or deletes steps files: each run reads only its own directory, so reads stay
narrow without merging, and an unreadable file is skipped with a warning, left where it is.

Login-side: pyarrow and pandas only, never torch (the runtime's writer is hpcrun.runtime.steps).
"""

from __future__ import annotations

import os
import typing as tp
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hpcrun.rundir import atomic_path, steps_batch, steps_dir
from hpcrun.tables import arrow_table, conform

if tp.TYPE_CHECKING:
    import pandas as pd

STR, INT, FLT, UTC = pa.string(), pa.int64(), pa.float64(), pa.timestamp("us", tz="UTC")

COLUMNS: dict[str, pa.DataType] = {
    "run_id": STR, "sweep_id": STR, "point_id": STR, "stage": STR, "strategy": STR, "job_id": STR, "attempt": INT,
    "step": INT,  # completed steps, 1-based
    "time": UTC,  # when the step ended
    "loss": FLT,  # the step's loss on the global batch (mean over ranks)
    "lr": FLT, "grad_norm": FLT,
    "step_time_s": FLT,  # rank 0's
    "step_time_min_s": FLT, "step_time_median_s": FLT, "step_time_max_s": FLT, "slowest_rank": INT,  # across ranks
    "tokens_per_s": FLT, "memory_bytes": INT,
}
SCHEMA = pa.schema([pa.field(n, t) for n, t in COLUMNS.items()] + [pa.field("extra", pa.map_(STR, FLT))])
ATTEMPT = ["run_id", "job_id", "attempt"]


def resolve_dir(results_dir: str | Path) -> str | Path:
    """A results directory, or a site name standing for its results directory."""
    if not Path(results_dir).is_dir() and isinstance(results_dir, str) and os.sep not in results_dir:
        from hpcrun.site import load_site

        return load_site(results_dir).results_dir
    return results_dir


def table(rows: list[dict[str, tp.Any]]) -> pa.Table:
    """Rows as an Arrow table of exactly SCHEMA."""
    return arrow_table(rows, SCHEMA, "steps")


def write_batch(results_dir: str | Path, rows: list[dict[str, tp.Any]], seq: int) -> Path:
    """One attempt's batch of step rows as one file (temporary name, synced, renamed)."""
    first = rows[0]
    path = steps_batch(results_dir, first["run_id"], first["job_id"], first["attempt"], seq)
    with atomic_path(path) as tmp:
        pq.write_table(table(rows), tmp)
    return path


def files(results_dir: str | Path) -> list[Path]:
    """Visible step files (temporary names of writes in progress start with a dot)."""
    directory = steps_dir(results_dir)
    return sorted(p for p in directory.rglob("*.parquet") if not p.name.startswith(".")) if directory.is_dir() else []


def read(paths: list[Path]) -> pa.Table:
    """Every row of `paths` as one table of SCHEMA. A file that is truncated or not a steps file
    is reported (a warning naming it) and skipped."""
    tables = []
    for path in paths:
        try:
            data, _ = conform(pq.read_table(path), SCHEMA)  # another hpcrun version's file loads with what it has
            if data.column("step").null_count or data.column("run_id").null_count:
                raise ValueError("rows without run_id or step")
            tables.append(data)
        except FileNotFoundError:
            continue  # removed since it was listed (a run directory cleaned up): nothing to report
        except (pa.ArrowException, OSError, KeyError, ValueError) as exc:
            warnings.warn(f"{path}: skipped, not a readable hpcrun steps file ({exc})", stacklevel=3)
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def stitch(df: pd.DataFrame) -> pd.DataFrame:
    """One curve per run, every step once. Attempts are taken in the order they ran (by their
    first row's time); an attempt whose first row is step s resumed from step s-1, so it
    supersedes every earlier attempt's rows from step s on (steps done after the checkpoint it
    resumed from, lost with that attempt)."""
    import pandas as pd

    if df.empty:
        return df
    starts = df.groupby(ATTEMPT, dropna=False).agg(first_step=("step", "min"), first_time=("time", "min")).reset_index()
    starts = starts.sort_values(["run_id", "first_time"], kind="stable")
    keep = []
    for run_id, attempts in starts.groupby("run_id", sort=False):
        rows = df[df["run_id"] == run_id]
        # walking backwards, each attempt keeps the steps below the earliest start seen after it
        limit: int | None = None
        for start in reversed(list(attempts.itertuples(index=False))):
            mine = rows[(rows["job_id"] == start.job_id) & (rows["attempt"] == start.attempt)]
            if limit is not None:
                mine = mine[mine["step"] < limit]
            keep.append(mine.drop_duplicates("step", keep="last"))
            first = int(tp.cast(tp.Any, start).first_step)
            limit = first if limit is None else min(limit, first)
    return pd.concat(keep).sort_values(["run_id", "step"], kind="stable").reset_index(drop=True)


def load_steps(
    results_dir: str | Path, run_id: str | list[str] | None = None, sweep_id: str | list[str] | None = None,
    strategy: str | list[str] | None = None, **filters: tp.Any,
) -> pd.DataFrame:
    """Every run's per-step metrics under `results_dir` (a directory, or a site name: its results
    directory), stitched across requeues, ordered by run and step. `filters` are column=value
    (or a list of values) equalities, as in hpcrun.results.load."""
    wanted = {k: v for k, v in (("run_id", run_id), ("sweep_id", sweep_id), ("strategy", strategy)) if v is not None}
    wanted.update(filters)
    for column in wanted:
        if column not in SCHEMA.names:
            raise KeyError(f"no column {column!r} to filter on")
    directory = resolve_dir(results_dir)
    paths = files(directory)
    if "run_id" in wanted:  # each run has its own directory: read only those asked for
        ids = wanted["run_id"] if isinstance(wanted["run_id"], (list, tuple, set)) else [wanted["run_id"]]
        paths = [p for p in paths if p.parent.name in set(ids)]
    df = stitch(read(paths).to_pandas(types_mapper=_dtype))  # before filtering: it needs every attempt
    for column, value in wanted.items():
        values = value if isinstance(value, (list, tuple, set)) else [value]
        df = df[df[column].isin(values)]
    return df.reset_index(drop=True)


def _dtype(arrow_type: pa.DataType) -> tp.Any:
    import pandas as pd

    return {pa.int64(): pd.Int64Dtype(), pa.float64(): pd.Float64Dtype(), pa.string(): pd.StringDtype()}.get(arrow_type)
