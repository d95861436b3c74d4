"""`hpcrun resume` (and `submit --run-id`) of a run whose latest job has not ended is refused
with one line naming the job (exit 2): two jobs would write one run's checkpoints. Local runs ask the controller's
liveness (the cluster's refusal, by squeue, is in test_cluster_submission.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from hpcrun.status import alive, controller_alive
from tests.runs import hpcrun, recipe, run_dir_of, site_copy, wait_for


def jobs(run_dir: Path) -> list[str]:
    return [job["job_id"] for job in json.loads((run_dir / "jobs.json").read_text())]


def test_resume_of_a_live_local_run_is_refused_and_of_an_ended_one_accepted(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    one_rank = {"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"}
    live = recipe(tmp_path, "live", job={"kind": "command", "command": ["sleep", "300"]}, resources=one_rank)
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(live)))
    (first,) = jobs(run_dir)
    try:
        refused = hpcrun("resume", "--site", str(site), run_dir.name, check=False)
        assert refused.returncode == 2, refused
        said = f"job {first} of this run is still RUNNING: wait for it to end, or cancel it (hpcrun cancel)"
        assert refused.stderr == f"Error: {run_dir}: {said}\n"
        # nor may `submit --run-id` of it rewrite the plan the live job reads when requeued
        plan = (run_dir / "runspec.json").read_text()
        other = recipe(tmp_path, "live", job={"kind": "command", "command": ["sleep", "1"]}, resources=one_rank)
        again = hpcrun("submit", "--site", str(site), "--run-id", run_dir.name, str(other), check=False)
        assert again.returncode == 2 and f"job {first} of this run is still RUNNING" in again.stderr, again
        assert (run_dir / "runspec.json").read_text() == plan and jobs(run_dir) == [first]
        hpcrun("cancel", "--site", str(site), run_dir.name)
        wait_for(lambda: not alive(first), what="the cancelled controller's end", timeout=60)
        hpcrun("resume", "--site", str(site), run_dir.name)
        assert len(jobs(run_dir)) == 2
    finally:  # every controller the run had, should a second one have been started
        for job in jobs(run_dir):
            if controller_alive(job, run_dir):
                os.kill(int(job), signal.SIGTERM)
