"""Cancelling a run's latest job: `scancel` on SLURM; locally, SIGTERM to the controller, which
forwards it so the ranks save and stop as they would on SLURM."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from hpcrun import slurm
from hpcrun.errors import HpcrunError
from hpcrun.rundir import RunDir
from hpcrun.status import controller_alive


def cancel(run_dir: Path) -> str:
    """Cancel the run's latest job; returns its id."""
    job = RunDir(run_dir).latest_job()
    if job is None:
        raise HpcrunError("no job was submitted for this run (a dry run?), so there is nothing to cancel", run_dir)
    if job["scheduler"] == "local":
        if controller_alive(job["job_id"], run_dir):  # not a process that reused the pid since
            os.kill(int(job["job_id"]), signal.SIGTERM)
        return str(job["job_id"])
    out = slurm.run(["scancel", job["job_id"]])
    if out.returncode != 0:
        raise HpcrunError(f"scancel failed: {out.stderr.strip() or out.stdout.strip()}")
    return str(job["job_id"])
