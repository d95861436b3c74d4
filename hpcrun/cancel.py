"""Cancelling a run's latest job: `scancel` on SLURM; locally, SIGTERM to the controller, which
forwards it so the ranks save and stop as they would on SLURM. A sweep's runs are cancelled with
one `scancel` naming each array once (`123_[0-999]`), not one call per point."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from hpcrun import backend, slurm
from hpcrun.errors import HpcrunError
from hpcrun.rundir import RunDir
from hpcrun.status import controller_alive, statuses

NOTHING = "no job was submitted for this run (a dry run?), so there is nothing to cancel"


def cancel(run_dir: Path) -> str:
    """Cancel the run's latest job; returns its id."""
    cancelled, skipped, ended = cancel_all([run_dir])
    if skipped:
        raise HpcrunError(NOTHING, run_dir)
    if ended:
        raise HpcrunError(already_ended(*ended[0]), run_dir)
    return cancelled[0][1]


def already_ended(run_dir: Path, job: str, state: str) -> str:
    return f"{run_dir.name} had already ended ({state}, job {job}): nothing cancelled"


def cancel_all(run_dirs: list[Path]) -> tuple[list[tuple[Path, str]], list[Path], list[tuple[Path, str, str]]]:
    """Cancel every run's latest job that has not ended: local ones by their controller, SLURM
    ones with one `scancel` (each array named once, its tasks as one range). Returns the (run
    dir, job id) pairs cancelled, the run dirs with no job to cancel (dry runs), and the (run
    dir, job id, state) of those whose job had already ended, which are left alone."""
    cancelled, on_slurm, skipped, ended = [], [], [], []
    pending = [RunDir(d) for d in run_dirs if RunDir(d).intent_file.exists()]
    if pending:  # a submission whose answer was lost: SLURM may hold its job, which is cancelled too
        backend.settle(pending)
    current = {s.run_id: s for s in statuses(run_dirs, max_age=0)}  # fresh: a job may have ended a moment ago
    for run_dir in run_dirs:
        job = RunDir(run_dir).latest_job()
        status = current.get(run_dir.name)
        if job is None:
            skipped.append(run_dir)
        elif status is not None and status.done:
            ended.append((run_dir, status.job_id, status.state))
        elif job["scheduler"] == "local":
            if controller_alive(job["job_id"], run_dir):  # not a process that reused the pid since
                os.kill(int(job["job_id"]), signal.SIGTERM)
            cancelled.append((run_dir, str(job["job_id"])))
        else:
            on_slurm.append((run_dir, str(job["job_id"])))
    if on_slurm:
        out = slurm.run(slurm.scancel([j for _, j in on_slurm]))
        if out.returncode != 0:
            raise HpcrunError(f"scancel failed: {slurm.said(out)}")
    return cancelled + on_slurm, skipped, ended
