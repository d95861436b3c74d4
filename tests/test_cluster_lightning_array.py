"""A Lightning job array on the real test cluster: the signalled task alone is requeued. In a
file of its own so that CI runs it beside tests/test_cluster_launchers.py, on another pool."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.runs import hpcrun, site_copy, state
from tests.test_cluster_launchers import lightning_job, reported, wait_reported
from tests.test_cluster_requeue import records, wait_done

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_lightning_array_requeues_only_the_signalled_task(tmp_path: Path) -> None:
    """Two sweep points as one job array (1 node x 2 ranks each): USR2 to task 0 requeues task 0
    alone (Lightning's own requeue once requeued whole arrays); both complete."""
    began = time.monotonic()
    site = site_copy(tmp_path, "testcluster")
    rec = tmp_path / "points.yaml"
    rec.write_text(json.dumps({
        "name": "points", "job": lightning_job(nodes=1, steps=40), "resources": {"nodes": 1, "gpus_per_node": 2, "time": "00:10:00"},
        "sweep": {"axes": {"training.seed": [1, 2]}},
    }))
    out = hpcrun("sweep", "--site", str(site), str(rec)).stdout
    assert "submitted 2 point(s)" in out, out
    sweep_dir = next((tmp_path / "runs" / "sweeps").iterdir())
    ledger = json.loads((sweep_dir / "ledger.json").read_text())["points"]
    by_task = {e["job_id"]: tmp_path / "runs" / e["run_id"] for e in ledger.values()}
    assert len(by_task) == 2 and len({j.split("_")[0] for j in by_task}) == 1, by_task  # one array
    first, second = sorted(by_task)
    wait_reported(by_task[first], first, 0, 5)
    subprocess.run(["scancel", "--signal=USR2", first], check=True)
    for task, run_dir in by_task.items():
        assert wait_done(run_dir, timeout=600)["status"] == "completed", task
    assert records(first) == ["REQUEUED", "COMPLETED"], records(first)
    assert records(second) == ["COMPLETED"], records(second)
    first_attempts = reported(by_task[first], first)
    assert len(first_attempts) == 2 and first_attempts[1][0] == first_attempts[0][-1] + 1, first_attempts
    assert state(by_task[second])["restart_count"] == 0
    print(f"duration {time.monotonic() - began:.0f} s")
