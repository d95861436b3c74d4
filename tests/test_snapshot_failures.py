"""Failed in-memory snapshots in the results row (`snapshot_failures`) and rank 0's summary line,
the last one of an attempt included: it may still be in flight when the training loop ends."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hpcrun import results
from tests import failing_snapshot
from tests.helpers import ROOT
from tests.runs import hpcrun, recipe, rows, run_dir_of, site_copy, state


@pytest.mark.slow
def test_a_snapshot_failing_after_the_last_step_is_counted_in_the_line_and_the_row(tmp_path: Path) -> None:
    """Snapshots every 2 steps of 8 (steps 2, 4, 6; 8 is the end), paced so that none is skipped;
    the write of step 6's fails with ENOSPC only after the last step has run: rank 0's summary
    line and the row both count it."""
    path = recipe(
        tmp_path, "failing", training={"steps": 8, "micro_batch": 2, "seq_len": 32, "warmup_steps": 1},
        checkpoint={"interval": 100, "memory_interval": 2},
        job=failing_snapshot.entrypoint_job(str(ROOT), step_delay_s=0.5, failing_step=6),
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site_copy(tmp_path)), "--wait", str(path)))
    assert state(run_dir)["status"] == "completed", state(run_dir)
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*_0_log.out"))
    assert re.search(r"snapshot of step 6 failed on rank 0 \(rank 0: OSError: \[Errno 28\]", logs), logs
    line = re.search(r"in-memory snapshots: (\d+) .*, (\d+) failed", logs)
    assert line and (int(line[1]), int(line[2])) == (3, 1), logs
    (row,) = rows(tmp_path, run_dir).to_dict("records")
    assert row["snapshot_failures"] == 1, row


def test_result_files_written_before_snapshot_failures_load_without_it(tmp_path: Path) -> None:
    """An older hpcrun's file has no `snapshot_failures` column: it loads, the column null there."""
    base = {"job_id": "1", "attempt": 0, "status": "completed"}
    newer = results.write_attempt(tmp_path, {**base, "run_id": "newer", "snapshot_failures": 2})
    older = results.write_attempt(tmp_path, {**base, "run_id": "older", "snapshot_failures": 0})
    pq.write_table(pq.read_table(older).drop_columns(["snapshot_failures"]), older)
    assert "snapshot_failures" in pq.read_schema(newer).names
    loaded = results.load(tmp_path).set_index("run_id")["snapshot_failures"]
    assert loaded["newer"] == 2 and loaded.isna()["older"], loaded
