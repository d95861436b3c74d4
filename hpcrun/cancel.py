"""Cancelling a run's latest job: `scancel` on SLURM; locally, SIGTERM to the controller, which
forwards it so the ranks save and stop as they would on SLURM. A sweep's runs are cancelled with
one `scancel` naming each array once (`123_[0-999]`), not one call per point."""

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


def cancel_all(run_dirs: list[Path]) -> list[tuple[Path, str]]:
    """Cancel every run's latest job: local ones one by one, SLURM ones with one `scancel` (the
    array tasks of each array written as one range). Returns (run dir, job id) pairs."""
    done, on_slurm = [], []
    for run_dir in run_dirs:
        job = RunDir(run_dir).latest_job()
        if job is None or job["scheduler"] == "local":
            done.append((run_dir, cancel(run_dir)))  # says why there is nothing to cancel, or signals the controller
        else:
            on_slurm.append((run_dir, str(job["job_id"])))
    if on_slurm:
        out = slurm.run(["scancel", *slurm.compress_ids([j for _, j in on_slurm])])
        if out.returncode != 0:
            raise HpcrunError(f"scancel failed: {out.stderr.strip() or out.stdout.strip()}")
    return done + on_slurm
