"""A function job: a pickled call submitted through hpcrun's submitit executor (hpcrun.executor).

Every task loads the run's function pickle (submitit's DelayedSubmission), calls it, and writes
its outcome where submitit's Job looks (`<folder>/<job>_<task>_result.pkl`: `("success", value)`
or `("error", traceback)`), so `job.result()` works as with submitit's own executors. A value is
written once the attempt's results row and state.json are: a caller that has it finds the run's
record too. The call
sees hpcrun's rank environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) and, through
`submitit.JobEnvironment()`, hpcrun's plugin environment; it creates its own process group.

Stopping. A call does not look at hpcrun's stop flag, so USR2 or SIGTERM interrupts it: the
handler raises Interrupted in it (as submitit's own handler does). Rank 0 then honours submitit's
Checkpointable protocol: the callable's `__submitit_checkpoint__` or `checkpoint(*args, **kwargs)`
returns the DelayedSubmission to run next, which replaces the run's pickle; the attempt then
ends as a stopped one and hpcrun requeues it (hpcrun.runtime.attempt). A callable without
`checkpoint` is decided as submitit's SignalHandler decides it: stopped at its time limit (judged
as has_timed_out does: hpcrun.runtime.timeouts.at_limit), it is not requeued, and its result
is submitit's error, "Job not requeued because: timed-out and not checkpointable."; preempted
(any stop before the time limit, or one whose job start has no record to judge it by), it is
requeued and called again from the start, as submitit requeues a preempted job whatever its
callable.

A stop may find the ranks in different collectives of the call's process group: hpcrun runs no
collective there, rank 0 alone records the attempt and requeues it (hpcrun.runtime.attempt), and
an error a rank gets once the stop has come (a peer that left a gloo collective) is the stop's.

Raising. An exception from the call is its outcome, not a fault: the error result is written,
the rank fails with CallRaised, and the failure step (hpcrun.runtime.failure) neither restarts
nor requeues the attempt, so the call runs once, as under submitit.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
import typing as tp
from pathlib import Path

from submitit.core.utils import DelayedSubmission, JobPaths, UncompletedJobError

from hpcrun import executor, outcome
from hpcrun.recipe import FunctionJob
from hpcrun.rundir import atomic_path
from hpcrun.runtime import timeouts
from hpcrun.runtime.context import Context

# submitit's reason for not requeueing a call without a checkpoint method at its time limit
# (submitit.core.job_environment.SignalHandler)
NOT_CHECKPOINTABLE = "timed-out and not checkpointable"


class CallRaised(Exception):
    """The call raised (the first line of its error): a result, which no restart or requeue changes."""


class Interrupted(BaseException):
    """Raised in the call by the stop signal's handler. A BaseException: a call's own `except
    Exception` must not swallow the stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int) -> None:
    raise Interrupted(signum)


def run_function(ctx: Context) -> None:
    job = ctx.recipe.job
    assert isinstance(job, FunctionJob)
    folder = outcome.call_folder(job, ctx.run_dir)
    result = JobPaths(folder, job_id=ctx.env.job_id, task_id=ctx.rank).result_pickle
    # what submitit's JobEnvironment reads (hpcrun.executor.HpcrunJobEnvironment)
    os.environ.update(SUBMITIT_EXECUTOR=executor.NAME, SUBMITIT_FOLDER=str(folder), HPCRUN_JOB_ID=ctx.env.job_id)
    delayed = DelayedSubmission.load(ctx.run_dir.function)
    try:
        try:
            ctx.flag.interrupt = _interrupt
            if ctx.flag.signum is not None:  # signalled before the call began
                raise Interrupted(ctx.flag.signum)
            value = delayed.result()
        finally:
            ctx.flag.interrupt = None
    except Interrupted as stop:
        return stopped(ctx, delayed, result, stop.signum)
    except Exception as exc:
        if ctx.flag.signum is not None:  # after a stop: its consequence (a peer left a collective), not the call's
            return stopped(ctx, delayed, result, ctx.flag.signum)
        outcome.write_outcome(result, ("error", traceback.format_exc()))
        raise CallRaised(f"{type(exc).__name__}: {exc}") from exc
    ctx.when_recorded.append(lambda: outcome.write_outcome(result, ("success", value)))


def stopped(ctx: Context, delayed: DelayedSubmission, result: Path, signum: int) -> None:
    """The call was interrupted by a stop: rank 0 checkpoints it (submitit's protocol) and, should
    the stop end the run, makes its error the call's result; at the time limit, a call it cannot
    checkpoint ends with submitit's error (`not_checkpointable`)."""
    ctx.stopped = signal.Signals(signum).name
    if ctx.env.is_main:
        if checkpoint_method(delayed) is None and ctx.spec.scheduler == "slurm" and _at_time_limit(ctx):
            not_checkpointable(ctx, result)
        checkpoint(ctx, delayed)
        ctx.when_recorded.append(lambda: _if_ended(ctx, result))
    ctx.info(f"{ctx.stopped}: the call was interrupted, stopping for requeue")


def checkpoint_method(delayed: DelayedSubmission) -> tp.Callable[..., tp.Any] | None:
    """The callable's side of submitit's Checkpointable protocol, if it has one."""
    function = delayed.function
    method = getattr(function, "__submitit_checkpoint__", None) or getattr(function, "checkpoint", None)
    return tp.cast("tp.Callable[..., tp.Any] | None", method)


def _at_time_limit(ctx: Context) -> bool:
    return bool(timeouts.at_limit(ctx.run_dir, ctx.env.allocation_id, ctx.env.attempt, ctx.flag.at or time.time(),
                                  ctx.spec.time_min, ctx.spec.signal_lead_s))


def not_checkpointable(ctx: Context, result: Path) -> tp.NoReturn:
    """A call without a checkpoint method stopped at its time limit: as under submitit, whose
    handler raises UncompletedJobError into the call, its result is that error, and the call
    raises it, so that the failure step neither restarts nor requeues the attempt."""
    error = UncompletedJobError(f"Job not requeued because: {NOT_CHECKPOINTABLE}.")
    outcome.write_outcome(result, ("error", "".join(traceback.format_exception_only(error))))
    raise CallRaised(f"{type(error).__name__}: {error} ({ctx.stopped} at the time limit; no checkpoint method)")


def checkpoint(ctx: Context, delayed: DelayedSubmission) -> None:
    """submitit's Checkpointable protocol: the call to make next replaces the run's pickle."""
    method = checkpoint_method(delayed)
    if method is None:
        ctx.info("the callable has no checkpoint method: the requeued job calls it again from the start")
        return
    following = method(*delayed.args, **delayed.kwargs)
    if following is None:
        ctx.info("the callable's checkpoint returned None: the requeued job calls it again from the start")
        return
    with atomic_path(ctx.run_dir.function) as tmp:
        following.dump(tmp)
    ctx.info("checkpointed the call: the requeued job continues from it")


def _if_ended(ctx: Context, result: Path) -> None:
    """A stop that ends the run (the requeue cap) is the call's outcome: an error with the reason,
    where submitit's Job looks, instead of a job that never produced output."""
    recorded = ctx.run_dir.state()
    if recorded.get("status") == "failed":
        outcome.write_outcome(result, ("error", f"the job was stopped and not requeued: {recorded.get('reason')}"))

