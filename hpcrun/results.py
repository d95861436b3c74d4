"""Parquet benchmark tables: one file per run attempt, the schema declared once, pandas out.

Writers never lock: each attempt writes its own file under a temporary name and renames it,
so hundreds of jobs can write at once and readers never see a partial file.
"""

from __future__ import annotations

import os
import typing as tp
import uuid
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

if tp.TYPE_CHECKING:
    import pandas as pd

S, I, F, T = pa.string(), pa.int64(), pa.float64(), pa.timestamp("us", tz="UTC")

# name -> type; provenance first, then what the runtime measures.
COLUMNS: dict[str, pa.DataType] = {
    "run_id": S, "sweep_id": S, "point_id": S, "stage": S, "site": S, "cluster": S, "partition": S,
    "nodes": I, "gpus_per_node": I, "world_size": I, "gpu_model": S, "interconnect": S,
    "strategy": S, "zero_stage": I, "offload_optimizer": S, "offload_param": S, "precision": S,
    "job_kind": S, "model": S, "parameters": I, "micro_batch": I, "grad_accum": I, "global_batch": I, "seq_len": I, "steps": I,
    "job_id": S, "node_list": S, "restart_count": I, "start_time": T, "end_time": T, "status": S, "reason": S,
    "hpcrun_version": S, "torch_version": S, "deepspeed_version": S, "nccl_version": S, "git_sha": S,
    "site_hash": S, "recipe_hash": S, "script_hash": S,
    "first_step": I, "last_step": I, "steps_timed": I, "step_time_p50_s": F, "step_time_p95_s": F,
    "tokens_per_s": F, "tokens_per_s_per_gpu": F, "samples_per_s": F, "tflops_per_gpu": F, "mfu": F,
    "peak_memory_bytes": I, "final_loss": F, "checkpoint_saves": I, "checkpoint_save_s": F, "checkpoint_stall_s": F,
}
SCHEMA = pa.schema([pa.field(n, t) for n, t in COLUMNS.items()] + [pa.field("extra", pa.map_(S, F))])


def table(rows: list[dict[str, tp.Any]]) -> pa.Table:
    """Rows as an Arrow table of exactly SCHEMA; an unknown column is an error, not a new column."""
    unknown = {k for r in rows for k in r} - set(SCHEMA.names)
    if unknown:
        raise ValueError(f"columns not in the results schema: {sorted(unknown)}")
    cols = {}
    for field in SCHEMA:
        values = [r.get(field.name) for r in rows]
        if field.name == "extra":
            values = [list((v or {}).items()) for v in values]
        cols[field.name] = pa.array(values, type=field.type)
    return pa.table(cols, schema=SCHEMA)


def write_attempt(results_dir: str | Path, row: dict[str, tp.Any]) -> Path:
    """One Parquet file for one run attempt, made visible by an atomic rename."""
    directory = Path(results_dir)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{row.get('run_id', 'run')}__{row.get('job_id', 'job')}__{row.get('restart_count', 0)}__{uuid.uuid4().hex[:8]}.parquet"
    tmp = directory / f".tmp-{name}"
    pq.write_table(table([row]), tmp)
    os.replace(tmp, directory / name)
    return directory / name


def files(results_dir: str | Path) -> list[Path]:
    """Visible result files: temporary names of writes in progress are not results yet."""
    directory = Path(results_dir)
    return sorted(p for p in directory.rglob("*.parquet") if not p.name.startswith(".")) if directory.is_dir() else []


def load(results_dir: str | Path, **filters: tp.Any) -> "pd.DataFrame":
    """All results under `results_dir` as a DataFrame with the schema's dtypes. A file that is
    truncated or not ours is reported (warning) and skipped. `filters` are column=value (or a
    list of values) equalities."""
    tables = []
    for path in files(results_dir):
        try:
            t = pq.read_table(path)
            tables.append(t.select(SCHEMA.names).cast(SCHEMA))
        except (pa.ArrowException, OSError, KeyError, ValueError) as exc:
            warnings.warn(f"{path}: skipped, not a readable hpcrun results file ({exc})", stacklevel=2)
    whole = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
    df = whole.to_pandas(types_mapper=_dtype)
    for column, wanted in filters.items():
        if column not in df.columns:
            raise KeyError(f"no column {column!r} to filter on")
        values = wanted if isinstance(wanted, (list, tuple, set)) else [wanted]
        df = df[df[column].isin(values)]
    return df.reset_index(drop=True)


def _dtype(arrow_type: pa.DataType) -> tp.Any:
    import pandas as pd

    return {pa.int64(): pd.Int64Dtype(), pa.float64(): pd.Float64Dtype(), pa.string(): pd.StringDtype()}.get(arrow_type)
