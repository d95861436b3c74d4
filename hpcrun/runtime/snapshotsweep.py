"""What earlier job starts and killed attempts left in a node's snapshot scratch, and who still
writes there (hpcrun.runtime.snapshot).

Snapshots are valid within one job start only (requeues and new jobs resume from disk, the durable
checkpoint); the batch script removes the job's directory on every node when the job ends, and
the next job on a node removes what an ended job could not (`sweep`). Every process holds a shared
lock on a file in each rank directory it writes (`OWNER`; the kernel drops it when the process
dies), so that what no live process writes is known: a run's next attempt or job on a node removes
the partial steps killed attempts left, and the run's directories of earlier job starts
(`sweep_run`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import typing as tp
from pathlib import Path

from hpcrun import rundir, slurm
from hpcrun.errors import HpcrunError

OWNER = ".owner"  # in a rank directory: share-locked by every live process that writes there


@contextlib.contextmanager
def unowned(rank_dir: Path) -> tp.Iterator[bool]:
    """Whether no live process writes in `rank_dir`; while true, none can begin to (a writer's
    claim of the directory waits)."""
    fd = None
    try:
        fd = os.open(rank_dir / OWNER, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        free = True
    except FileNotFoundError:  # no process has written there yet: the owner file comes first
        free = True
    except OSError:  # a live owner holds it (BlockingIOError), or none can be told: one is assumed
        free = False
    try:
        yield free
    finally:
        if fd is not None:
            os.close(fd)


def remove_partial_steps(rank_dir: Path) -> None:
    for leftover in rundir.partial_step_dirs(rank_dir):
        shutil.rmtree(leftover, ignore_errors=True)


def remove_empty(*paths: Path) -> None:
    for path in paths:
        try:
            path.rmdir()
        except OSError:  # not empty: another rank's or run's directories are still there
            pass


def sweep(scratch: Path, allocation_id: str, slurm_requeues: int, others: bool) -> None:
    """Remove what earlier job starts left in this node's scratch: this job's before its latest
    requeue and, with `others` (a SLURM job), any job of this user SLURM no longer lists (a batch
    shell killed before its exit cleared its nodes: a preemption past its grace time). Only on
    an answer that lists this job too; without SLURM's tools here (a container), only this job's."""
    for n in range(slurm_requeues):
        shutil.rmtree(rundir.snapshot_job_dir(scratch, allocation_id, n), ignore_errors=True)
    ended = {job: paths for job, paths in rundir.snapshot_job_dirs(scratch).items() if job != allocation_id}
    if not others or not ended:
        return
    try:
        listed = slurm.run(slurm.my_allocations())
    except HpcrunError:
        return
    running = set(listed.stdout.split())
    if listed.returncode != 0 or allocation_id not in running:  # an answer that misses this job is not one
        return
    for job, paths in ended.items():
        if job not in running:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)


def sweep_run(scratch: Path, job_dir: Path, run_id: str, host: str) -> None:
    """Remove what this node holds of run `run_id` that no live process writes and no restore can
    use: in this job start's directory `job_dir` the partial steps of killed attempts (on a tight
    tmpfs they would make every later snapshot fail), in other job starts' directories (another job
    of the run, a requeue's whose exit could not clear the node) the whole rank directories, as
    snapshots never serve across job starts (a requeue or a new job resumes from disk)."""
    for paths in rundir.snapshot_job_dirs(scratch).values():
        for start in paths:
            current = start.name == job_dir.name
            for rank_dir in rundir.snapshot_ranks(start, run_id, host).values():
                with unowned(rank_dir) as free:
                    if free and current:
                        remove_partial_steps(rank_dir)
                    elif free:
                        shutil.rmtree(rank_dir, ignore_errors=True)
            if not current:
                remove_empty(start / run_id / host, start / run_id, start)


def sweep_past(job_dir: Path, run_id: str, host: str, held: set[int]) -> None:
    """Remove what this node holds of this job start that the ranks now running neither write nor
    receive (`held`): survivors' saves write every rank's directory on every node, and a shrink
    leaves a larger world's, whose engine state's links would keep copies in memory to the job's end;
    and the survivors' claims. Once every rank's restore has read what the node holds."""
    root = job_dir / run_id / host
    for rank, rank_dir in rundir.snapshot_ranks(job_dir, run_id, host).items():
        if rank not in held:
            with unowned(rank_dir) as free:
                if free:
                    shutil.rmtree(rank_dir, ignore_errors=True)
    for claim in root.glob(f"{rundir.SURVIVOR_CLAIM}*"):
        claim.unlink(missing_ok=True)
