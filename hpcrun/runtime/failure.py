"""A failed attempt, recorded once and by one writer, with the rank, node and signal that ended
it, and what comes next: the step again inside the job, a requeue, or a stop.

A failing rank only leaves an exit record (its error, step and node: hpcrun.rundir's
`exit_record`), and the batch script, which outlives srun, runs `python -m hpcrun.runtime.failure
RUN_DIR STATUS` (srun's messages on its stdin) once the step has ended, as one task inside the
ranks' container. That one process finds the rank that ended the step first
(hpcrun.runtime.cause), writes the attempt's results row and state.json, and decides: a restart
inside the job on the nodes it names (hpcrun.runtime.nodes), a requeue (hpcrun.runtime.requeue),
or a stop (the same failure again, a call's own error, the cap). `--site local`'s controller
(hpcrun.localjob) records its failed attempts the same way, with no restart or requeue.

Runs on the batch node after srun: imports no torch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import signal
import sys
import typing as tp
from pathlib import Path

from hpcrun import jobstate, slurm
from hpcrun.errors import HpcrunError
from hpcrun.goodput import detect_s
from hpcrun.plan import RunSpec
from hpcrun.recipe import FunctionJob
from hpcrun.rundir import CorruptStateError, RunDir, current_names, read_json, write_json
from hpcrun.runtime import heartbeat
from hpcrun.runtime.cause import CONSEQUENCE, Failure, first_failure, step_message
from hpcrun.runtime.nodes import clear_node_dirs, exclusions, partition_size, probed_nodes, restart_nodes
from hpcrun.runtime.requeue import REQUEUEING, requeue
from hpcrun.runtime.row import plan_row

# state.json keys that describe the run, not one attempt: every writer of state.json keeps them
RUN_LONG = ("failed_nodes", "excluded_nodes", "slow_ranks")
# state.json's reason when the failure step starts the training step again inside the job
RESTARTING = "restarting in the job"
# a rank's watchdog's word (hpcrun.runtime.watchdog); the writer adds which ranks went silent
HUNG = "hung (no step progress for fault.hang_timeout_s)"
PEER_SILENT = "a peer fell silent (no pulse for fault.peer_timeout_s)"  # the watchdog adds which


class Stop:
    """A stop signal to the failure step itself: SLURM signals every step of the job ahead of its
    time limit or a preemption (`--signal`, scancel), this one too, once. Caught rather than fatal
    (the attempt's record is written all the same), it turns a restart inside the job into a
    requeue. A signal the batch shell gets after the step ended is not seen here (it ignores it)."""

    def __init__(self) -> None:
        self.came: str | None = None

    def catch(self) -> None:
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._caught)

    def _caught(self, signum: int, frame: tp.Any) -> None:
        self.came = self.came or signal.Signals(signum).name


def job_ids() -> tuple[str, int, int]:
    """This attempt's job id as the ranks name it (`<array>_<index>` for array tasks), hpcrun's
    attempt number and SLURM's requeue count (hpcrun.runtime.env)."""
    return slurm.job_id(os.environ), slurm.attempt_number(os.environ), slurm.requeue_count(os.environ)


def run_long(state: dict[str, tp.Any], job_id: str | None = None) -> dict[str, tp.Any]:
    """What state.json keeps across attempts: the run's nodes and slow ranks, and the counts of
    restarts inside `job_id` and of its requeues after a timeout while it is that job's."""
    kept = {k: state[k] for k in RUN_LONG if k in state}
    if job_id is not None and state.get("job_id") == job_id:
        kept.update({k: state[k] for k in (jobstate.IN_JOB, jobstate.TIMEOUTS) if state.get(k)})
    return kept


def rank_row(record: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The row a failing rank wrote into its exit record, with its times as datetimes again."""
    row = current_names(dict(record.get("row") or {}))  # an exit record of an older hpcrun's rank
    for key in ("start_time", "end_time"):
        if isinstance(row.get(key), str):
            row[key] = dt.datetime.fromisoformat(row[key])
    return row


def name_silent(run_dir: RunDir, job_id: str, attempt: int, failure: Failure, record: dict[str, tp.Any] | None,
                world_size: int) -> Failure:
    """A hang (`record`: the rank that saw it first) with the ranks whose process had stopped when
    it fired, read from their heartbeats here, once for the attempt (hpcrun.runtime.heartbeat),
    and told on stderr with how long each was silent."""
    if record is None or failure.what != HUNG:
        return failure
    found = heartbeat.silent(run_dir, job_id, attempt, world_size, float(record.get("time") or 0), skip=failure.rank)
    if not found:
        return failure
    print(f"[hpcrun] silent ranks: {'; '.join(found)}", file=sys.stderr)
    return dataclasses.replace(failure, what=f"{HUNG}; silent: {heartbeat.short(found)}")


def write_exit_record(
    run_dir: RunDir, job_id: str, attempt: int, rank: int, error: str, step: int, row: dict[str, tp.Any],
    final: bool = False, stepped: float | None = None,
) -> None:
    """A failing rank's word, for the one writer of the attempt's record. `final`: the error is
    the run's outcome (a function job's call raised), which no restart or requeue changes.
    `stepped`: when its last completed step ended (unix time; None: none did), and `time` when it
    noticed: the failure's detection (hpcrun.goodput)."""
    import time

    record = {
        "rank": rank,
        "node": os.environ.get("SLURMD_NODENAME"),
        "error": error,
        "step": step,
        "time": time.time(),
        "row": row,
        "final": final,
        "stepped": stepped,
    }
    write_json(run_dir.exit_record(job_id, attempt, rank), json.loads(json.dumps(record, default=str)))


def _said(path: Path) -> dict[str, tp.Any]:
    """A JSON file a rank rewrites as it trains (a heartbeat, progress.json), or {}: one cut off
    by the rank's death says nothing, and must not keep the attempt from being recorded."""
    try:
        value = read_json(path, {})
    except CorruptStateError:
        return {}
    return current_names(value) if isinstance(value, dict) else {}


def reached(
    run_dir: RunDir, job_id: str, attempt: int, records: list[dict[str, tp.Any]], beat: dict[str, tp.Any]
) -> tuple[int | None, int | None]:
    """How far the attempt got, in steps done: the step it resumed at and the furthest it reached,
    None where nothing says. The ranks' exit records say both (the step each failed in, its row's
    first step); rank 0's heartbeat (`beat`) and progress.json, when they are this attempt's, how
    far it got where no rank lived to write one. One file each: not every rank's heartbeat."""
    rows = [r["row"] for r in records if isinstance(r.get("row"), dict)]
    resumed = min((int(row["first_step"]) for row in rows if isinstance(row.get("first_step"), int)), default=None)
    steps = [int(r["step"]) for r in records if isinstance(r.get("step"), int)]
    step = beat.get("step")
    if isinstance(step, int) and step >= 0:  # the index of its last completed step; -1: none yet
        steps.append(step + 1)
    progress = _said(run_dir.progress)
    if (progress.get("job_id"), progress.get("attempt")) == (job_id, attempt) and isinstance(
        progress.get("step"), int
    ):
        steps.append(int(progress["step"]))
    return resumed, max(steps, default=None)


def progressed_at(records: list[dict[str, tp.Any]], beat: dict[str, tp.Any]) -> float | None:
    """When the attempt last made progress (unix time): the latest end of a completed step that the
    exit records or rank 0's heartbeat (`beat`, written every few seconds) tell; None: none told.
    Not progress.json's `updated`: that is when its writer got round to it, after the step."""
    ends = [float(r["stepped"]) for r in records if isinstance(r.get("stepped"), (int, float))]
    if isinstance(beat.get("step"), int) and beat["step"] >= 0 and isinstance(beat.get("stepped"), (int, float)):
        ends.append(float(beat["stepped"]))
    return max(ends, default=None)


def signature(error: str, resumed: int | None, furthest: int | None) -> dict[str, tp.Any]:
    """What state.json keeps of a failure, for the next attempt's `same_again`."""
    return {"error": error, "resumed": resumed, "reached": furthest}


def same_again(previous: tp.Any, now: dict[str, tp.Any]) -> bool:
    """The previous attempt's failure again: the same error (the same words: a rank or node it
    names included) and either no progress in this attempt (no step completed past where it
    resumed) or an end at the very step the previous attempt reached (a crash the data or the code
    brings back at that step). Restarts resume from in-memory snapshots, far more often than disk
    checkpoints are written, so how far each attempt got is what tells progress, not the newest
    checkpoint; and an attempt resumed from an older save (a requeue resumes from disk) that dies
    short of where the last one did has still progressed."""
    if not isinstance(previous, dict) or previous.get("error") != now["error"]:
        return False
    if now["reached"] is None:
        return True
    if now["resumed"] is not None and now["reached"] <= now["resumed"]:
        return True
    return isinstance(previous.get("reached"), int) and now["reached"] == previous["reached"]


def failed_call(job: FunctionJob, run_dir: RunDir, job_id: str, world_size: int, error: str) -> None:
    """A function job whose call raised: the tasks srun ended before they wrote an outcome (a
    peer's call raised first) get its error where submitit's Job looks, so `job.result()` says it."""
    from submitit.core.utils import JobPaths

    from hpcrun.outcome import call_folder, write_outcome

    folder = call_folder(job, run_dir)
    for task in range(world_size):
        path = JobPaths(folder, job_id=job_id, task_id=task).result_pickle
        if not path.exists():
            write_outcome(path, ("error", f"another task's call raised: {error}"))


def record_failed_step(
    run_dir: RunDir, step_status: int, srun_stderr: str, stop: Stop | None = None,
    ids: tuple[str, int, int] | None = None,
) -> str | None:
    """The failed attempt's one results row and state, and the requeue when the cap allows and
    the failure is not the previous attempt's again (nor a restart inside the job once `stop`
    caught a signal). Returns the reason (None: already recorded by a rank, e.g. a stop for
    requeue or the cap). `ids`: the job id, attempt and requeue count where no SLURM variables
    say them (hpcrun.localjob, whose runs `hpcrun resume` continues: no requeue)."""
    from hpcrun.results import write_attempt

    spec = RunSpec.model_validate(read_json(run_dir.spec, None))
    job_id, attempt, slurm_requeues = ids or job_ids()
    records = [r for r in (read_json(p, None) for p in run_dir.exit_records(job_id, attempt)) if isinstance(r, dict)]
    failure = first_failure(srun_stderr, records)
    if failure is None:
        failure = Failure(None, None, step_message(srun_stderr) or f"status {step_status}", None)
    own = next((r for r in records if r.get("rank") == failure.rank), None)
    # the batch script's word (none locally: a local run inherits no allocation's, even inside one)
    told: tp.Mapping[str, str] = os.environ if spec.scheduler == "slurm" else {}
    step_nodes = [n for n in told.get("HPCRUN_STEP_NODES", "").split(",") if n]
    world = len(step_nodes) * spec.ranks_per_node or None  # fewer than planned after a shrink
    failure = name_silent(run_dir, job_id, attempt, failure, own, world or spec.world_size)
    # only the first failing rank's own record makes the failure the call's result: a rank that died
    # without one (SIGKILL, OOM, a segfault) raised nothing, and a peer's error after it is its consequence
    call_error = str(own.get("error")) if own is not None and own.get("final") else None
    final = call_error is not None
    if call_error is not None and isinstance(spec.recipe.job, FunctionJob):
        failed_call(spec.recipe.job, run_dir, job_id, spec.world_size, call_error)
    beat = _said(run_dir.heartbeat(job_id, attempt, 0))
    said_failure = signature(failure.what, *reached(run_dir, job_id, attempt, records, beat))
    progressed = progressed_at(records, beat)
    noticed = [float(r["time"]) for r in records if isinstance(r.get("time"), (int, float))]
    said = rank_row(own or next(iter(records), None) or {})
    row = {**plan_row(spec, job_id, attempt, ",".join(step_nodes) or told.get("SLURM_JOB_NODELIST"), world),
           **said}
    cap = spec.recipe.checkpoint.max_requeues
    in_job = int(told.get("HPCRUN_RESTARTS_IN_JOB") or 0)
    next_file = told.get("HPCRUN_NEXT_NODES")
    may_restart = bool(next_file) and in_job < spec.recipe.fault.restarts_in_job
    probes = told.get("HPCRUN_PROBES")
    probed = probed_nodes(step_nodes, srun_stderr, Path(probes) if probes else None)
    lost = probed.lost  # also for a requeue: the next start excludes them
    # the batch script's expansion of the job's node list: the spares are the ones not in the step
    allocated = [n for n in told.get("HPCRUN_JOB_NODES", "").split(",") if n] or step_nodes
    room = 0
    if lost and spec.recipe.fault.exclude_failed_nodes:
        try:  # SLURM's tools may not answer: the attempt is recorded all the same
            room = partition_size(spec.partition)
        except HpcrunError as exc:
            print(f"[hpcrun] excluding the lost nodes: {exc.format_message()}", file=sys.stderr)
    if lost and (failure.node not in lost and CONSEQUENCE.search(failure.what) or failure.rank is None):
        # only survivors told srun (a lost node's tasks never do): the cause is the node, named by its first rank
        first = step_nodes.index(lost[0]) * spec.ranks_per_node if lost[0] in step_nodes else None
        failure = Failure(first, lost[0], f"node lost: {','.join(lost)}", failure.step)
    elif lost:
        failure = dataclasses.replace(failure, what=f"{failure.what}; node lost: {','.join(lost)}")
    if probed.silent:
        failure = dataclasses.replace(
            failure, what=f"{failure.what}; no answer from {','.join(probed.silent)} (nor from SLURM's controller: "
            "not counted lost)"
        )
    decided: dict[str, tp.Any] = {}

    def merge(state: dict[str, tp.Any]) -> dict[str, tp.Any] | None:
        # decided under state.json's lock, against what is there now
        if (state.get("job_id"), state.get("attempt")) == (job_id, attempt):
            decided["requeue"] = state.get("status") in (REQUEUEING, "requeued")  # rank 0 said so, then was killed
            return None
        previous = (
            state.get("failure") if (state.get("job_id"), state.get("attempt")) == (job_id, attempt - 1) else None
        )
        reason = failure.describe()
        long = run_long(state, job_id)
        if lost:
            long["failed_nodes"] = sorted(set(state.get("failed_nodes") or []) | set(lost))
            long["excluded_nodes"] = exclusions(state, lost, room, spec.nodes)
        nodes = None
        if may_restart and not final:  # silent nodes only where others can take their place: not a requeue
            nodes = restart_nodes(spec, state, step_nodes, allocated, lost + probed.silent)
            nodes = nodes or restart_nodes(spec, state, step_nodes, allocated, lost)
            if nodes is None and spec.shrinks:  # none to take a lost node's place (now or before): train on without
                nodes = restart_nodes(spec, state, step_nodes, allocated, lost + probed.silent, spec.min_nodes)
                nodes = nodes or restart_nodes(spec, state, step_nodes, allocated, lost, spec.min_nodes)
        stopped = stop.came if stop is not None else None
        if final:
            reason += "; the call's own error, its result: not run again"
        elif same_again(previous, said_failure):
            reason += "; the same failure as the previous attempt (same error, no step past it): not requeued"
        elif nodes is not None and not stopped:
            decided["restart"] = nodes
            reason += f"; {RESTARTING} ({in_job + 1} of {spec.recipe.fault.restarts_in_job})"
            if len(nodes) < spec.nodes:
                reason += f" on {len(nodes)} of {spec.nodes} nodes ({','.join(nodes)}), the same global batch"
            elif set(nodes) - set(step_nodes):
                reason += f" on {','.join(nodes)}"
        else:
            if nodes is not None:  # the job is to leave: a restart would run on with no stop coming
                reason += f"; {stopped} during the failure step: not restarted in the job"
            if spec.scheduler != "slurm":
                reason += "; continue with hpcrun resume"
            elif slurm_requeues >= cap:
                reason += f"; requeue cap reached ({cap} requeues)"
            else:
                decided["requeue"] = True
                reason += f"; {REQUEUEING}"  # until SLURM has (settle)
        decided["reason"] = reason
        # the row before the state, so whoever reads "failed" finds it (see attempt.finish)
        now = dt.datetime.now(dt.timezone.utc)
        # noticed by the first rank that left a record, else by this record: the next attempt's restart_s starts here
        said_failure["detected"] = detected = min(noticed, default=now.timestamp())
        row.update(status="failed", reason=reason, end_time=now, detect_s=detect_s(progressed, detected))
        write_attempt(spec.results_dir, row)
        restarts = int(long.get(jobstate.IN_JOB) or 0) + (1 if "restart" in decided else 0)
        return {**long, "status": "failed", "reason": reason, "job_id": job_id, "attempt": attempt,
                "step": row.get("last_step"), "failure": said_failure, jobstate.IN_JOB: restarts}

    run_dir.update_state(merge)
    if decided.get("restart") and next_file:
        with open(next_file, "w") as out:  # the batch script starts the step again on these nodes
            out.write(",".join(decided["restart"]) + "\n")
    elif decided.get("requeue"):
        unclear = clear_node_dirs([n for n in allocated if n not in lost + probed.silent])
        if unclear:  # the next start on a node sweeps what is left there
            print(f"[hpcrun] node-local directories not removed before the requeue: {unclear}", file=sys.stderr)
        requeue(run_dir, job_id, attempt, slurm_requeues)
    return decided.get("reason")


def main(argv: list[str]) -> int:
    """`python -m hpcrun.runtime.failure RUN_DIR STATUS < SRUN_STDERR`, from the sbatch script.
    A state file it cannot read or a SLURM tool that fails is one line and exit status 1."""
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m hpcrun.runtime.failure RUN_DIR STATUS < SRUN_STDERR", file=sys.stderr)
        return 2
    stop = Stop()
    stop.catch()
    srun_stderr = sys.stdin.buffer.read().decode(errors="replace")
    try:
        reason = record_failed_step(RunDir(argv[0]), int(argv[1]), srun_stderr, stop)
    except HpcrunError as exc:
        print(f"[hpcrun] recording the failed attempt: {exc.format_message()}", file=sys.stderr)
        return 1
    if reason:
        print(f"[hpcrun] attempt failed: {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
