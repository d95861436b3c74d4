"""A stop at the job's time limit, counted apart from preemptions (`checkpoint.max_timeouts`,
submitit's `max_num_timeout`). submitit's JobEnvironment.has_timed_out judges a stop by how long
the job had run when its signal came; so does hpcrun, from this start of the job (the batch
script's record), its time limit and the signal lead. A job's count lives in state.json
(jobstate.TIMEOUTS), kept across its requeues and reset for a new job, as its requeues are.
Imports no torch: the stop decision (hpcrun.runtime.attempt) asks here."""

from __future__ import annotations

import os
import typing as tp

from hpcrun import jobstate
from hpcrun.rundir import RunDir

# How much earlier than `time limit - signal lead` a stop at the limit may come, as measured here:
# SLURM sends a `--signal` up to 60 s before the time asked for (its event resolution), and the
# batch script records its start some seconds after the job's (the prolog, the shell's start)
SLACK_S = 90


def allocation_start(run_dir: RunDir, allocation_id: str, attempt: int, restarts_in_job: int) -> float | None:
    """When this start of the job began (epoch seconds): the batch script's line for its first
    training step, `restarts_in_job` lines before this attempt's (`attempt`, hpcrun's number of
    it, is its line). None: there is no such line (the task was not started by hpcrun's script)."""
    try:
        lines = run_dir.starts(allocation_id).read_text().splitlines()
    except FileNotFoundError:
        return None
    index = attempt - restarts_in_job
    if not 0 <= index < len(lines):
        return None
    fields = lines[index].split(" ")  # not split(): SLURM_RESTART_COUNT is empty before the first requeue
    try:
        return float(fields[2])
    except (IndexError, ValueError):
        return None


def timed_out(started: float, signalled: float, time_min: int, lead_s: int) -> bool:
    """Whether a stop signalled at `signalled` came at the time limit of a job started at `started`:
    within the signal lead (and SLACK_S) of `time_min`. Any other stop (a preemption, an
    `scancel --signal`) came earlier."""
    return signalled - started >= time_min * 60 - lead_s - SLACK_S


def this_start(run_dir: RunDir, allocation_id: str, attempt: int) -> float | None:
    """When the job start of this attempt (`attempt`, after the restarts inside it the batch script
    says) began: `allocation_start`."""
    return allocation_start(run_dir, allocation_id, attempt, int(os.environ.get("HPCRUN_RESTARTS_IN_JOB") or 0))


def at_limit(run_dir: RunDir, allocation_id: str, attempt: int, signalled: float, time_min: int,
             lead_s: int) -> bool | None:
    """Whether a stop signalled at `signalled` came at this start's time limit (`timed_out`); None:
    no record of when this start of the job began (the batch script's), so no telling it from a
    preemption."""
    started = this_start(run_dir, allocation_id, attempt)
    return None if started is None else timed_out(started, signalled, time_min, lead_s)


def counted(state: dict[str, tp.Any], job_id: str) -> int:
    """The timeouts state.json holds for `job_id` (another job's are not this job's)."""
    return int(state.get(jobstate.TIMEOUTS) or 0) if state.get("job_id") == job_id else 0
