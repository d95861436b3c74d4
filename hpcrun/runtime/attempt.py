"""One run attempt's lifecycle around the training loop: start (distributed init, the Context),
the stop decision after a signal, requeueing, the results row and state.json, and the export
of the final weights. The loop itself is hpcrun.runtime.context and hpcrun.runtime.jobs."""

from __future__ import annotations

import os
import time
import typing as tp

import torch
import torch.distributed as dist

from hpcrun import jobstate, slurm
from hpcrun.errors import HpcrunError
from hpcrun.plan import RunSpec
from hpcrun.rundir import RunDir, atomic_path, atomic_write
from hpcrun.runtime import checkpoint as ckpt
from hpcrun.runtime import failure, nodes, predecessors, requeue, timeouts
from hpcrun.runtime.context import SURVIVOR_WAIT_S, Context
from hpcrun.runtime.env import DistEnv, from_scheduler, init_process_group
from hpcrun.runtime.function import CallRaised
from hpcrun.runtime.jobs import JOBS
from hpcrun.runtime.metrics import peak_memory_bytes
from hpcrun.runtime.row import result_row
from hpcrun.runtime.watchdog import flight_recorder_env
from hpcrun.signals import FLAG


def run(spec: RunSpec) -> dict[str, tp.Any]:
    """One rank of one attempt of `spec`. Returns this rank's summary; raises when the job
    failed (after recording it, and requeueing where the cap allows)."""
    # a restart inside the job: the previous attempt's ranks on this node may still be exiting;
    # waited for before from_scheduler, whose set_device already takes a context on the GPU
    waited, attempt = 0.0, slurm.attempt_number(os.environ)
    if spec.scheduler == "slurm" and attempt > 0 and "SLURM_JOB_ID" in os.environ:
        waited = predecessors.wait_gone(os.environ["SLURM_JOB_ID"], attempt)
    env = from_scheduler()
    FLAG.install()  # done by hpcrun.launch already; again in case the task was started otherwise
    # every rank's own log says whose it is: a failure is read in one rank's file
    print(
        f"[hpcrun] rank {env.rank}/{env.world_size} (local {env.local_rank}) "
        f"on {os.environ.get('SLURMD_NODENAME', os.uname().nodename)}, job {env.job_id}, attempt {env.attempt}"
        f" (requeues {env.slurm_requeues})",
        flush=True,
    )
    # a command job's own script owns MASTER_PORT; a function creates its own process group, as under submitit
    if spec.recipe.job.kind not in ("command", "function"):
        if env.backend == "nccl":
            flight_recorder_env(RunDir(spec.run_dir))  # read when the process group is created
        init_process_group(env, spec.recipe.fault.collective_timeout_s)
    ctx = Context(spec, env, FLAG)
    ctx.measured.restart_wait_s = waited
    if spec.scheduler == "slurm" and env.is_main:  # an attempt lost with its node left no record
        try:
            lost = nodes.lost_attempt(ctx.run_dir, spec, env.job_id, env.attempt, env.slurm_requeues,
                                        env.allocation_id)
        except HpcrunError as exc:  # accounting unreachable from the node: train on, unrecorded
            lost = None
            ctx.info(f"could not check how the previous attempt ended: {exc.format_message()}")
        if lost:
            ctx.info(f"previous attempt: {lost}")
    status, reason, job_timeouts = "completed", None, None
    try:
        JOBS[spec.recipe.job.kind](ctx)
        ctx.checkpoints.wait()  # a job that left `steps()` early may have a save in flight
        if ctx.stopped:
            status, reason, job_timeouts = stop_decision(ctx)
        ctx.close_snapshots(status)
    except Exception as exc:
        raised = isinstance(exc, CallRaised)
        status, reason = "failed", str(exc) if raised else f"{type(exc).__name__}: {exc}"
        if not raised:  # a peer's death, or this rank's own error: the state of the last completed step stays
            ctx.keep_survivor_state(SURVIVOR_WAIT_S)
        if spec.scheduler == "slurm":  # recorded once, after srun, by hpcrun.runtime.failure
            latest = ctx.measured.latest  # the end of this rank's last completed step: where detection starts
            failure.write_exit_record(ctx.run_dir, env.job_id, env.attempt, env.rank, reason, ctx.step,
                                      result_row(ctx, status, reason, peak_memory_bytes(ctx.device)), final=raised,
                                      stepped=ctx.measured.unix_time(latest) if latest and latest.steps else None)
        else:  # locally the first failing rank records the attempt (finish keeps the first)
            finish(ctx, status, reason, collective=False)
        try:  # after the record: the watcher may end the step once the survivors' saves are done
            ctx.end_loop()
        except Exception as ended:  # noqa: BLE001 - the failure is recorded whatever the loop's end does
            ctx.info(f"ending the loop after the failure: {type(ended).__name__}: {ended}")
        raise
    if ctx.engine is not None and status == "completed" and spec.recipe.checkpoint.export_final:
        export_final(ctx)
    # a function job's process group is the call's own: hpcrun runs no collective on it (ranks a
    # stop interrupted in different collectives would hang, and a rank whose call returned before
    # the signal reached it cannot tell); rank 0 alone records the attempt and requeues a stop.
    # A gloo rank left waiting for a peer that has gone is released by the peer's exit; an NCCL
    # one only by the group's timeout
    alone = spec.recipe.job.kind == "function"
    row = {}
    if env.is_main or not alone:
        row = finish(ctx, status, reason, collective=not alone, job_timeouts=job_timeouts)
    for then in ctx.when_recorded:
        then()
    if status == "requeued" and env.is_main:
        # before destroy_process_group: a rank that exits badly meanwhile gets rank 0 killed
        # (--kill-on-bad-exit, or the batch script's watcher); then the failure step, seeing
        # `requeueing`, requeues instead
        requeue_now(env, ctx.run_dir)
    if dist.is_initialized() and not alone:
        dist.destroy_process_group()
    return {"status": status, "reason": reason, "rank": env.rank, "step": ctx.step, "final_loss": row.get("final_loss")}


def stop_decision(ctx: Context) -> tuple[str, str | None, int | None]:
    """After the stop checkpoint: requeue on SLURM unless a cap is reached (`max_requeues`, and
    `max_timeouts` for a stop at the time limit). Locally, `hpcrun resume` continues. Also returns
    the job's count of timeouts after this one when it is one that is counted (else None)."""
    caps = ctx.recipe.checkpoint
    where = f"{ctx.stopped} at step {ctx.step + 1}"
    if ctx.spec.scheduler != "slurm":
        return "stopped", f"{where}; continue with hpcrun resume", None
    if ctx.env.slurm_requeues >= caps.max_requeues:
        return "failed", f"requeue cap reached ({caps.max_requeues} requeues); {where}", None
    if caps.max_timeouts is None:
        return "requeued", where, None
    limit = at_time_limit(ctx)
    if limit is None:
        ctx.info("no record of when this job started: its stop is not counted as a timeout")
        return "requeued", where, None
    if not limit:
        return "requeued", f"{where}, before the time limit", None
    done = timeouts.counted(ctx.run_dir.state(), ctx.env.job_id)
    if done >= caps.max_timeouts:
        return "failed", f"timeout cap reached ({caps.max_timeouts} timeouts); {where}, at the time limit", None
    return "requeued", f"{where}, at the time limit (timeout {done + 1} of {caps.max_timeouts})", done + 1


def at_time_limit(ctx: Context) -> bool | None:
    """Whether this attempt's stop signal came at the job's time limit, judged as submitit's
    has_timed_out does (hpcrun.runtime.timeouts); None: no record of when this start of the job
    began (the batch script's), so no telling it from a preemption."""
    return timeouts.at_limit(ctx.run_dir, ctx.env.allocation_id, ctx.env.attempt, ctx.flag.at or time.time(),
                             ctx.spec.time_min, ctx.spec.signal_lead_s)


def requeue_now(env: DistEnv, run_dir: RunDir | None = None) -> None:
    """Requeue this job, unless SLURM is already doing so (preemption requeues by itself, and
    twice would count twice). SLURM holds a requeued job for the site's `AuthInfo=cred_expire`
    (120 s by default) before it may start again: a floor on requeue latency set by the site."""
    # env.job_id is hpcrun.slurm.job_id: `<array>_<index>` for array tasks. Should SLURM's tool fail,
    # this rank fails, and the failure step after srun tries again
    requeue.requeue(run_dir, env.job_id, env.attempt, env.slurm_requeues, last_try=False)


def finish(ctx: Context, status: str, reason: str | None, collective: bool,
           job_timeouts: int | None = None) -> dict[str, tp.Any]:
    """Gather across ranks (when all are alive) and write this attempt's state.json, its results
    row and its losses (rank 0, or locally the first failing rank, since a failed rank 0 may
    never get here). One row per attempt: a writer that finds the attempt failed already
    writes nothing. `job_timeouts`: the job's count of timeouts, when this stop added one."""
    m = ctx.measured
    m.checkpoint_writes = ctx.checkpoints.write_times
    peak = peak_memory_bytes(ctx.device)
    if collective:
        m.losses = ctx.global_losses()
        if dist.is_initialized() and ctx.world_size > 1:  # the largest of every rank's, and its longest wait
            most = torch.tensor([peak, round(m.restart_wait_s * 1000)], dtype=torch.int64, device=ctx.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            peak, m.restart_wait_s = int(most[0].item()), int(most[1].item()) / 1000
    if not (ctx.env.is_main or not collective):
        return {}
    row = result_row(ctx, status, reason, peak)
    job_id, attempt = ctx.env.job_id, ctx.env.attempt
    # a requeue is `requeued` in state.json only once SLURM has made it (hpcrun.runtime.requeue.settle)
    recorded = requeue.REQUEUEING if status == "requeued" else status
    said = {"status": recorded, "reason": reason, "job_id": job_id, "attempt": attempt, "step": row["last_step"]}
    from hpcrun.results import write_attempt

    wrote = False

    def merge(current: dict[str, tp.Any]) -> dict[str, tp.Any] | None:
        # one failed rank fails the attempt, whatever the ranks that finished write after it
        nonlocal wrote
        if (current.get("job_id"), current.get("attempt")) == (job_id, attempt) and current.get(
            "status"
        ) == "failed":
            return None
        # the row and losses before the state: whoever sees "completed" (--wait, a stage's
        # dependency, a test) finds the attempt's results already there
        write_attempt(ctx.spec.results_dir, row)
        if m.losses:
            atomic_write(ctx.run_dir.losses(job_id, attempt), "\n".join(repr(x) for x in m.losses))
        wrote = True
        counted = {jobstate.TIMEOUTS: job_timeouts} if job_timeouts is not None else {}
        return {**said, **failure.run_long(current, job_id), **counted}  # failed and excluded nodes stay the run's

    ctx.run_dir.update_state(merge)
    return row if wrote else {}


def export_final(ctx: Context) -> None:
    """The final weights as one plain fp32 state dict (written atomically by rank 0) and their
    sha256: what the next stage loads whatever its strategy, and what exact-resume checks
    compare. Collective: ZeRO-3 and FSDP gather their shards for it."""
    state = ctx.engine.full_state()
    if ctx.env.is_main:
        with atomic_path(ctx.run_dir.final_weights) as tmp:
            torch.save({k: v.float() for k, v in state.items()}, tmp)
        atomic_write(ctx.run_dir.weights_digest, ckpt.state_digest(state) + "\n")
