"""Parquet benchmark tables: one file per run attempt, the schema declared once, pandas out.

Writers never lock: each attempt writes its own file under a temporary name and renames it,
so hundreds of jobs can write at once and readers never see a partial file. When small files
accumulate, the next reader merges them (`compact_when_many`: `load`, so `hpcrun results` and
notebooks), so reads stay fast at campaign size with no manual step, and no job spends its stop
path (KillWait after SIGTERM) rewriting the history.

Files from other hpcrun versions load with what they have: columns an older version did not
write are null, columns a newer one added are left out (and compaction leaves such a file as it
is, rather than drop its columns). A file that cannot be read, or is not an hpcrun results file,
is skipped with a warning by readers and moved by compaction into `unreadable/` (which readers
skip), never deleted: it may be the only copy of its rows. Compaction removes exactly the files
whose rows it wrote.
"""

from __future__ import annotations

import datetime as dt
import os
import stat
import typing as tp
import uuid
import warnings
from pathlib import Path

import filelock
import pyarrow as pa
import pyarrow.parquet as pq

from hpcrun import rundir
from hpcrun.rundir import RENAMED, CorruptStateError, atomic_path, compact_lock, read_json, write_json
from hpcrun.steps import load_steps, resolve_dir
from hpcrun.tables import arrow_table, conform, current_columns, fold, reading_schema

__all__ = [
    "SCHEMA",
    "compact",
    "compact_when_many",
    "files",
    "load",
    "load_steps",
    "read",
    "resolve_dir",
    "run_rows",
    "table",
    "write_attempt",
]

if tp.TYPE_CHECKING:
    import pandas as pd

S, I, F, T = pa.string(), pa.int64(), pa.float64(), pa.timestamp("us", tz="UTC")  # noqa: E741 (short type names keep the schema table readable)

# name -> type; provenance first, then what the runtime measures.
COLUMNS: dict[str, pa.DataType] = {
    "attempt_id": S,
    "run_id": S,
    "sweep_id": S,
    "point_id": S,
    "stage": S,
    "site": S,
    "cluster": S,
    "partition": S,
    "nodes": I,
    "gpus_per_node": I,
    "world_size": I,
    "gpu_model": S,
    "interconnect": S,
    "strategy": S,
    "zero_stage": I,
    "offload_optimizer": S,
    "offload_param": S,
    "plan_option": S,  # the memory planner's name for the layout (hpcrun plan): ddp, fsdp-full, zero3-nvme, ...
    "precision": S,
    "job_kind": S,
    "model": S,
    "parameters": I,
    "micro_batch": I,
    "grad_accum": I,
    "global_batch": I,
    "seq_len": I,
    "activation_checkpointing": I,  # 0 or 1
    "steps": I,
    "seed": I,
    "job_id": S,
    "node_list": S,
    "attempt": I,
    "start_time": T,
    "end_time": T,
    "status": S,
    "reason": S,
    "hpcrun_version": S,
    "torch_version": S,
    "deepspeed_version": S,
    "nccl_version": S,
    "git_sha": S,
    "site_hash": S,
    "recipe_hash": S,
    "script_hash": S,
    "first_step": I,
    "last_step": I,
    "steps_timed": I,
    "step_time_p50_s": F,
    "step_time_p95_s": F,
    "tokens_per_s": F,  # per mean step time after the warm-up steps: hpcrun's per-step work in, stalls out
    # tokens over the wall time of the same steps: from the end of the last warm-up step (after its save or
    # snapshot) to the end of the attempt's last step (after its save or snapshot, the final blocking save
    # included), so steps, hpcrun's per-step work and stalls all count. An attempt of no more steps than the
    # warm-up is timed from its loop's start, as tokens_per_s times all its steps. Null where tokens_per_s
    # is, for command jobs (hpcrun runs no loop of theirs), and in files written before it was measured.
    "wall_tokens_per_s": F,
    "tokens_per_s_per_gpu": F,
    "samples_per_s": F,
    "tflops_per_gpu": F,
    "mfu": F,
    "peak_memory_bytes": I,
    "final_loss": F,
    "checkpoint_saves": I,
    "checkpoint_save_s": F,
    "checkpoint_stall_s": F,
    "checkpoint_write_s": F,
    "snapshot_stall_s": F,  # the training thread's stall in in-memory snapshots, summed as checkpoint_stall_s is
    # in-memory snapshots that failed on some rank, the last one (still in flight when the steps ended)
    # included; every rank counts alike. Null in files written before it was counted
    "snapshot_failures": I,
    # the share of wall_tokens_per_s's wall time the training thread stalled in the saves and snapshots
    # taken within it (a background write's cost shows only as slower steps); those of the warm-up
    # steps count in the two sums of stalls, not here. Null as wall_tokens_per_s is, but for want of tokens
    "recovery_overhead": F,
    # a restart's wait at start for the previous attempt's processes to leave its nodes (the longest rank's)
    "restart_wait_s": F,
    # per fault (hpcrun.goodput), null where there was none and in files written before they were measured.
    # A failed attempt's seconds from its last completed step to the first rank that noticed (or to its record)
    "detect_s": F,
    # the attempt after a failed one: seconds from that notice (after a requeue: from the job's new start) to its
    # first step, the steps it ran again (the failed attempt's furthest, less where it resumed) and their time
    "restart_s": F,
    "recomputed_steps": I,
    "recompute_s": F,
    "slow_ranks": S,
    "resumed_from": S,  # memory / replica / survivor (in-memory snapshots), disk, or None: started from step 0
}
SCHEMA = pa.schema([pa.field(n, t) for n, t in COLUMNS.items()] + [pa.field("extra", pa.map_(S, F))])


AUTO_COMPACT_FILES = 256  # small result files beyond which a reader merges them (compact_when_many)


def table(rows: list[dict[str, tp.Any]]) -> pa.Table:
    """Rows as an Arrow table of exactly SCHEMA."""
    return arrow_table(rows, SCHEMA, "results")


def write_attempt(results_dir: str | Path, row: dict[str, tp.Any]) -> Path:
    """One Parquet file for one run attempt, made visible by an atomic rename. `attempt_id`
    is the row's identity: readers drop copies of it (compaction briefly makes some)."""
    directory = Path(results_dir)
    directory.mkdir(parents=True, exist_ok=True)
    row = {**row, "attempt_id": row.get("attempt_id") or uuid.uuid4().hex}
    ids = (row.get("run_id", "run"), row.get("job_id", "job"), row.get("attempt", 0), row["attempt_id"])
    path = rundir.attempt_file(directory, *ids)
    _write_atomic(table([row]), path)
    return path


def compact_when_many(results_dir: str | Path, limit: int = AUTO_COMPACT_FILES) -> None:
    """Keep reads fast with no manual step: when more than `limit` files have accumulated, the
    reader that sees it merges them (`compact`), unless another compaction runs now (it never
    waits). Every ~`limit` attempts one reader pays ~1 ms per file; reads then see at most
    `limit` small files plus the merged ones. A compaction that fails (a read-only results
    directory, say) is a warning: the read goes on."""
    directory = Path(results_dir)
    try:
        left = set(read_json(rundir.compact_left(directory), []) or [])
    except CorruptStateError:  # only spares a merge that merges nothing: a bad copy costs one merge
        left = set()
    waiting = [p for p in files(directory) if str(p.relative_to(directory)) not in left]
    if len(waiting) <= limit or not os.access(directory, os.W_OK | os.X_OK):
        return  # a read-only results directory is read as it is
    try:
        compact(directory, wait=False)
    except (OSError, pa.ArrowException) as exc:
        warnings.warn(f"{directory}: results not compacted ({exc}); `hpcrun results compact` merges them", stacklevel=2)


def _write_atomic(data: pa.Table, path: Path) -> None:
    """Under a hidden temporary name (which `files` skips), synced, then renamed (rundir's one way)."""
    with atomic_path(path) as tmp:
        pq.write_table(data, tmp)


def files(results_dir: str | Path) -> list[Path]:
    """Visible result files: temporary names of writes in progress are not results yet, and the
    per-step dataset under `steps/` is another table (hpcrun.steps)."""
    directory = Path(results_dir)
    if not directory.is_dir():
        return []
    others = (rundir.RESULTS_STEPS, rundir.UNREADABLE)  # another table; files set aside
    visible = (p for p in directory.rglob("*.parquet") if not p.name.startswith("."))
    return sorted(p for p in visible if p.relative_to(directory).parts[0] not in others)


class Vanished(Exception):
    """A listed file was removed before it was read (a compaction merged it)."""


def read(paths: list[Path]) -> pa.Table:
    """The rows of `paths` as one table of SCHEMA, copies of an attempt dropped. All files at
    once (threaded) when they are sound; file by file, skipping and reporting bad ones, if not."""
    import pyarrow.dataset as ds  # here, not at the top: it imports pandas (0.7 s), which writers (rank 0) never need

    if not paths:
        return SCHEMA.empty_table()
    try:  # a dataset with SCHEMA fills the columns a file lacks with nulls and leaves out the ones it adds
        # (and with the old names of renamed columns, folded into today's: files of older versions mixed in)
        whole = fold(ds.dataset([str(p) for p in paths], schema=reading_schema(SCHEMA), format="parquet").to_table(),
                     SCHEMA)
        if whole.column("attempt_id").null_count:  # a foreign file read as null rows
            raise ValueError("rows without attempt_id")
    except (pa.ArrowException, OSError, ValueError):
        tables = []
        for path in paths:
            try:
                tables.append(read_one(path)[0])
            except Unreadable as exc:
                warnings.warn(f"{path}: skipped, {exc}", stacklevel=3)
        whole = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
    return _unique(whole)


class Unreadable(Exception):
    """A file that cannot be read as hpcrun results now (the message says why). `broken`: it
    never will be (not Parquet, not ours), so compaction sets it aside; otherwise (an I/O error,
    a column whose type another version changed) it is left where it is."""

    def __init__(self, why: str, broken: bool) -> None:
        super().__init__(why)
        self.broken = broken


def read_one(path: Path) -> tuple[pa.Table, bool]:
    """One file's rows as SCHEMA, and whether it had columns SCHEMA lacks: columns an older hpcrun
    did not write are null, columns a newer one added are left out. Raises Vanished if the file
    is gone, Unreadable if it is not ours."""
    try:
        data = pq.read_table(path)
    except FileNotFoundError as exc:
        raise Vanished(str(path)) from exc
    except pa.ArrowInvalid as exc:
        raise Unreadable(f"not a readable Parquet file ({exc})", broken=True) from exc
    except OSError as exc:  # EIO, ESTALE, EACCES: the file may be whole
        raise Unreadable(f"could not be read ({exc})", broken=False) from exc
    except pa.ArrowException as exc:
        raise Unreadable(f"not a readable Parquet file ({exc})", broken=True) from exc
    if "attempt_id" not in data.column_names or data.column("attempt_id").null_count:
        raise Unreadable("not an hpcrun results file (rows without attempt_id)", broken=True)
    try:
        return conform(data, SCHEMA)
    except (pa.ArrowException, ValueError) as exc:
        raise Unreadable(f"a column of another type than hpcrun's ({exc})", broken=False) from exc


def _unique(data: pa.Table) -> pa.Table:
    ids = data.column("attempt_id").to_pylist()
    seen: set[str | None] = set()
    keep = [i for i, a in enumerate(ids) if not (a in seen or seen.add(a))]  # type: ignore[func-returns-value]
    return data if len(keep) == len(ids) else data.take(keep)


def load(results_dir: str | Path, **filters: tp.Any) -> pd.DataFrame:
    """All results under `results_dir` (a directory, or a site name: its results directory) as
    a DataFrame with the schema's dtypes. A file that is truncated or not ours is reported
    (warning) and skipped. Merges the small files first when many have accumulated. `filters`
    are column=value (or a list of values) equalities.
    Per-step metrics: `load_steps` (hpcrun.steps)."""
    results_dir = resolve_dir(results_dir)
    compact_when_many(results_dir)
    for attempt in range(5):
        try:
            data = read(files(results_dir))
            break
        except Vanished:  # merged into a new file meanwhile: list again, it is there now
            if attempt == 4:
                raise
    df = data.to_pandas(types_mapper=_dtype)
    for column, wanted in filters.items():
        if column not in df.columns:
            raise KeyError(f"no column {column!r} to filter on")
        values = wanted if isinstance(wanted, (list, tuple, set)) else [wanted]
        df = df[df[column].isin(values)]
    return df.reset_index(drop=True)


def run_rows(results_dir: str | Path, run_id: str, columns: tp.Sequence[str]) -> list[dict[str, tp.Any]]:
    """One run's rows, `columns` of them only (None where a file lacks one), without reading the
    rest of the table: the run's own attempt files and the merged ones, with pyarrow.parquet
    alone (`read` takes pyarrow.dataset, which imports pandas: `hpcrun status` on a login node
    does without). A file that is not readable results is skipped with a warning."""
    directory = Path(results_dir)
    wanted = list(dict.fromkeys(["attempt_id", "run_id", *columns]))
    for attempt in range(5):
        found: dict[str, dict[str, tp.Any]] = {}
        try:
            for path in files(directory):
                if "__" in path.name and not path.name.startswith(f"{run_id}__"):
                    continue  # another run's attempt file (hpcrun.rundir.attempt_file)
                for row in _rows_of(path, run_id, wanted):
                    found.setdefault(str(row["attempt_id"]), row)  # compaction briefly leaves copies
            return list(found.values())
        except Vanished:  # merged into a new file meanwhile: list again, it is there now
            if attempt == 4:
                raise
    return []


def _rows_of(path: Path, run_id: str, columns: list[str]) -> list[dict[str, tp.Any]]:
    try:
        data = pq.ParquetFile(path)
        names = data.schema_arrow.names
        old = [o for o, new in RENAMED.items() if new in columns and o in names]  # an older version's name
        present = [c for c in columns if c in names] + old
        read = data.read(columns=present) if "run_id" in present else SCHEMA.empty_table().select(["run_id"])
        read = current_columns(read)  # a file of an older version: its columns under today's names
        # a zoned timestamp's to_pylist imports pandas: read the UTC values unzoned, zoned again below
        zoned = {f.name: f.type.unit for f in read.schema if pa.types.is_timestamp(f.type) and f.type.tz}
        for name, unit in zoned.items():
            read = read.set_column(read.schema.get_field_index(name), name, read[name].cast(pa.timestamp(unit)))
        rows = read.to_pylist()
    except FileNotFoundError as exc:
        raise Vanished(str(path)) from exc
    except (pa.ArrowException, OSError) as exc:
        warnings.warn(f"{path}: skipped, not readable results ({exc})", stacklevel=3)
        return []
    return [
        {**dict.fromkeys(columns), **row, **{k: row[k].replace(tzinfo=dt.timezone.utc) for k in zoned if row[k]}}
        for row in rows if row.get("run_id") == run_id and row.get("attempt_id")
    ]


def compact(results_dir: str | Path, wait: bool = True) -> tuple[int, int]:
    """Merge the directory's files into one, idempotently and while jobs keep writing.

    Only the files present at the start are merged; new ones are left for next time. The merged
    file becomes visible (atomic rename) before the originals are removed, so a reader sees
    every row at every moment (copies meanwhile are dropped by `attempt_id`). A lock keeps two
    compactions from merging the same files; `wait=False` returns at once, merging nothing,
    when another holds it. Returns (files merged, rows written)."""
    directory = Path(results_dir)
    directory.mkdir(parents=True, exist_ok=True)
    lock = compact_lock(directory)
    try:
        lock.acquire(timeout=-1 if wait else 0)
    except filelock.Timeout:
        return 0, 0
    try:
        tables, merged_paths, left = [], [], []
        for path in files(directory):
            try:
                data, newer = read_one(path)
            except Vanished:
                continue  # removed by someone else since it was listed: nothing of it to merge
            except Unreadable as exc:
                if exc.broken and removable(path):
                    set_aside(directory, path, str(exc))
                else:
                    warnings.warn(f"{path}: {exc}; left as it is, not merged", stacklevel=2)
                    left.append(path)
                continue
            # a newer hpcrun's file stays as it is (merging it here would drop its new columns), and so does one
            # this user may not remove: merging it would leave its rows twice, and merge them again at every read
            if not newer and removable(path):
                tables.append(data)
                merged_paths.append(path)
            else:
                left.append(path)
        write_json(rundir.compact_left(directory), sorted(str(p.relative_to(directory)) for p in left))
        if len(merged_paths) <= 1:
            return 0, 0
        merged = _unique(pa.concat_tables(tables))
        _write_atomic(merged, rundir.compacted_file(directory, uuid.uuid4().hex[:12]))
        for path in merged_paths:  # exactly the files whose rows the merged file holds
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # its rows are in the merged file too; readers drop the copies
                warnings.warn(f"{path}: merged but not removed ({exc})", stacklevel=2)
        return len(merged_paths), merged.num_rows
    finally:
        lock.release()


def removable(path: Path) -> bool:
    """Whether this process may remove `path`: its directory is writable and, where that directory
    is sticky (a results directory a group shares), the file or the directory is this user's."""
    directory = path.parent
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    uid = os.geteuid()
    if uid == 0:
        return True
    try:
        held = directory.stat()
        return not held.st_mode & stat.S_ISVTX or uid in (held.st_uid, path.stat().st_uid)
    except OSError:
        return False


def set_aside(directory: Path, path: Path, why: str) -> Path:
    """Move a file compaction cannot merge into `unreadable/` (readers skip it), under a name
    no other file there has, and say so once. Never deleted: it may be the only copy of rows."""
    aside = rundir.unreadable_dir(directory)
    aside.mkdir(exist_ok=True)
    target = aside / path.name
    while target.exists():
        target = aside / f"{path.stem}-{uuid.uuid4().hex[:8]}{path.suffix}"
    path.rename(target)
    warnings.warn(f"{path}: {why}; moved to {target}, not merged", stacklevel=3)
    return target


def _dtype(arrow_type: pa.DataType) -> tp.Any:
    import pandas as pd

    return {pa.int64(): pd.Int64Dtype(), pa.float64(): pd.Float64Dtype(), pa.string(): pd.StringDtype()}.get(arrow_type)
