"""Run directories and tables written before hpcrun named its counters attempt, requeue and restart
in the job read as today's: `restart_count` (hpcrun's attempt number) in state.json,
progress.json, exit records and the results and steps tables is `attempt` (hpcrun.rundir.RENAMED),
and a results or steps directory holding files of both versions reads as one table."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hpcrun import progress, steps
from hpcrun.results import compact, files, load, run_rows, table, write_attempt
from hpcrun.rundir import RunDir, attempt_file, steps_batch
from hpcrun.runtime.failure import rank_row
from hpcrun.status import statuses

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def as_older_version(data: pa.Table) -> pa.Table:
    """`data` as an hpcrun before the rename wrote it: `restart_count`, and without a column added since."""
    renamed = data.rename_columns(["restart_count" if n == "attempt" else n for n in data.column_names])
    return renamed.drop_columns([n for n in ("wall_tokens_per_s", "extra") if n in renamed.column_names])


def old_row(results: Path, run_id: str, attempt: int, status: str) -> None:
    row = {"attempt_id": f"{run_id}-{attempt}", "run_id": run_id, "job_id": "7", "attempt": attempt, "status": status,
           "nodes": 1, "tokens_per_s": 100.0, "start_time": T0}
    pq.write_table(as_older_version(table([row])), attempt_file(results, run_id, "7", attempt, row["attempt_id"]))


def test_old_and_new_results_files_load_as_one_table(tmp_path: Path) -> None:
    old_row(tmp_path, "old", 0, "failed")
    old_row(tmp_path, "old", 1, "completed")
    write_attempt(tmp_path, {"run_id": "new", "job_id": "8", "attempt": 2, "status": "completed", "nodes": 1,
                             "wall_tokens_per_s": 90.0})
    old = [p for p in files(tmp_path) if p.name.startswith("old")]
    assert all("restart_count" in pq.read_schema(p).names for p in old)  # really the old format
    df = load(tmp_path).sort_values(["run_id", "attempt"])
    assert "restart_count" not in df.columns
    assert list(zip(df.run_id, df.attempt, df.status)) == [
        ("new", 2, "completed"), ("old", 0, "failed"), ("old", 1, "completed")
    ]
    assert df.set_index("run_id").wall_tokens_per_s.isna().tolist() == [False, True, True]  # an old file lacks it
    assert load(tmp_path, attempt=1).run_id.tolist() == ["old"]  # filters take today's name
    # `hpcrun status`'s narrow read of one run, and `hpcrun results`' careful file-by-file read (a foreign file in)
    assert sorted(r["attempt"] for r in run_rows(tmp_path, "old", ["attempt", "status"])) == [0, 1]
    (tmp_path / "foreign.parquet").write_bytes(b"not parquet")
    assert sorted(load(tmp_path).attempt.tolist()) == [0, 1, 2]


def test_compaction_merges_old_files_under_the_new_name(tmp_path: Path) -> None:
    """An old file is not a newer version's (whose unknown columns compaction would keep by leaving it)."""
    old_row(tmp_path, "old", 0, "failed")
    old_row(tmp_path, "old", 1, "completed")
    write_attempt(tmp_path, {"run_id": "new", "job_id": "8", "attempt": 0, "status": "completed"})
    assert compact(tmp_path) == (3, 3)
    (merged,) = files(tmp_path)
    assert "attempt" in pq.read_schema(merged).names and "restart_count" not in pq.read_schema(merged).names
    assert sorted(load(tmp_path).attempt.tolist()) == [0, 0, 1]


def test_old_steps_files_stitch_with_new_ones(tmp_path: Path) -> None:
    """Attempt 0 (an old file) reached step 10; attempt 1 (a new one) resumed from step 5."""
    def batch(attempt: int, first: int, last: int) -> list[dict[str, object]]:
        return [{"run_id": "r", "job_id": "7", "attempt": attempt, "step": s, "loss": float(100 * attempt + s),
                 "time": T0 + dt.timedelta(seconds=100 * attempt + s)} for s in range(first, last + 1)]

    old = steps_batch(tmp_path, "r", "7", 0, 0)
    old.parent.mkdir(parents=True)
    pq.write_table(as_older_version(steps.table(batch(0, 1, 10))), old)
    steps.write_batch(tmp_path, batch(1, 6, 12), 0)
    curve = steps.load_steps(tmp_path, run_id="r")
    assert curve.step.tolist() == list(range(1, 13))
    assert curve.attempt.tolist() == [0] * 5 + [1] * 7


def test_an_old_state_json_reads_as_today_s(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    (run_dir.path / "runspec.json").write_text("{}")
    run_dir.state_file.write_text(json.dumps({"status": "failed", "job_id": "7", "restart_count": 3}))
    assert run_dir.state() == {"status": "failed", "job_id": "7", "attempt": 3}
    seen = []
    run_dir.update_state(lambda state: seen.append(state) or {**state, "status": "requeued"})  # type: ignore[func-returns-value]
    assert seen == [{"status": "failed", "job_id": "7", "attempt": 3}]
    assert json.loads(run_dir.state_file.read_text()) == {"status": "requeued", "job_id": "7", "attempt": 3}
    # `hpcrun status` of a local run whose controller is gone: requeues from the state's attempt
    gone = subprocess.Popen(["true"])  # noqa: S607
    gone.wait()
    run_dir.jobs_file.write_text(json.dumps([{"job_id": str(gone.pid), "scheduler": "local", "submitted": 0}]))
    run_dir.state_file.write_text(json.dumps({"status": "completed", "job_id": str(gone.pid), "restart_count": 2}))
    (status,) = statuses([run_dir.path])
    assert status.state == "COMPLETED" and status.requeues == 2


def test_an_old_progress_json_and_exit_record_read_as_today_s(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    run_dir.progress.write_text(json.dumps({"step": 4, "total": 10, "updated": 1.0, "job_id": "7", "restart_count": 2}))
    found = progress.read(tmp_path)
    assert found is not None and found.attempt == 2
    row = rank_row({"row": {"run_id": "r", "restart_count": 1, "start_time": T0.isoformat()}})
    assert row == {"run_id": "r", "attempt": 1, "start_time": T0}
