"""A failed attempt, recorded once and by one writer, with the rank, node and signal that ended it.

When one rank dies, the others fail a moment later ("Connection closed by peer") or are killed
by srun (`--kill-on-bad-exit`); none of them knows who died first. So a failing rank only leaves
an exit record (its error, step and node: hpcrun.rundir's `exit_record`), and the batch script,
which outlives srun, runs `python -m hpcrun.runtime.failure RUN_DIR STATUS` (srun's messages on its
stdin) once the step has ended, as one task inside the ranks' container: srun's own messages
("srun: error: node2: task 3: Killed") say which task ended first. That one process writes the
attempt's results row and state.json and decides the requeue.

A lost node takes its batch script with it; SLURM requeues the job (NODE_FAIL) and the next
attempt's start records the lost attempt from sacct (`lost_attempt`), and the node is excluded
from the job's later attempts (`fault.exclude_failed_nodes`). SLURM updates a job's ExcNodeList
only while it is pending, so the exclusion is applied right after each requeue hpcrun makes.

Runs on the batch node after srun: imports no torch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as dt
import json
import os
import re
import signal
import sys
import typing as tp

from hpcrun import jobstate, slurm
from hpcrun.errors import HpcrunError, ToolError
from hpcrun.plan import RunSpec
from hpcrun.rundir import RunDir, read_json, step_dirs, write_json
from hpcrun.runtime import heartbeat
from hpcrun.runtime.row import plan_row

# srun's message when a task ends badly, e.g. "srun: error: node2: task 3: Killed" or
# "srun: error: node1: tasks 0-1: Exited with exit code 1"
SRUN_ERROR = re.compile(r"srun: error: (?P<node>[^:\s]+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+)")
SIGNAL_WORDS = {
    "Killed": "SIGKILL", "Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Terminated": "SIGTERM",
    "Bus error": "SIGBUS", "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL",
}
# slurmstepd's word when the step was ended from outside, e.g. "*** STEP 12.0 ON node1 CANCELLED AT
# 2024-01-01T00:00:00 DUE TO TIME LIMIT ***": the step id and the time differ every attempt
STEP_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT \S+(?P<why> DUE TO [^*]+?)? \*\*\*")
# what a rank reports when it only saw another one go (the cause is elsewhere)
CONSEQUENCE = re.compile(r"closed by peer|reset by peer|Broken pipe|Connection refused", re.IGNORECASE)
# state.json keys that describe the run, not one attempt: every writer of state.json keeps them
RUN_LONG = ("failed_nodes", "excluded_nodes", "slow_ranks")
# state.json's status from the decision to requeue until SLURM's answer (settle): then
# `requeued`, or `stopped` with why not
REQUEUEING = "requeueing"
# state.json's reason when the failure step starts the training step again inside the job
RESTARTING = "restarting in the job"
# how long a probe step may take to answer before its node counts as lost (a live one: milliseconds)
PROBE_S = 5.0
# a rank's watchdog's word (hpcrun.runtime.watchdog); the writer adds which ranks went silent
HUNG = "hung (no step progress for fault.hang_timeout_s)"


@dataclasses.dataclass(frozen=True)
class Failure:
    """What ended an attempt first: a rank (and its node) and how it ended."""

    rank: int | None
    node: str | None
    what: str  # "Killed (SIGKILL)", "exit code 1", "RuntimeError: ..."
    step: int | None  # the step it failed in, when the rank said so

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "the job step"
        where = f" on {self.node}" if self.node else ""
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{who}{where}: {self.what}{at}"

    def signature(self, checkpoint: int | None) -> dict[str, tp.Any]:
        """Same step and same error: the same failure again (any rank, any node). Without a
        step (no rank lived to say it: SIGKILL, a cancelled step), the same error with no new
        checkpoint since (`checkpoint`: the newest one now) is the same failure again."""
        if self.step is None:
            return {"checkpoint": checkpoint, "error": self.what}
        return {"step": self.step, "error": self.what}


def job_ids() -> tuple[str, int, int]:
    """This attempt's job id as the ranks name it (`<array>_<index>` for array tasks), hpcrun's
    attempt number and SLURM's requeue count (hpcrun.runtime.env)."""
    return slurm.job_id(os.environ), slurm.attempt_number(os.environ), slurm.requeue_count(os.environ)


def lost_step_nodes(step_nodes: list[str], srun_stderr: str) -> list[str]:
    """The nodes of a step the batch script had to end (its lost tasks never reported) that do not
    answer a probe step now: lost. A probe ends in milliseconds on a live node."""
    if slurm.SRUN_ENDED not in srun_stderr:
        return []

    def dead(node: str) -> bool:
        try:
            return slurm.run(slurm.probe_node(node), timeout=PROBE_S).returncode != 0
        except ToolError:  # srun itself missing here: nothing is known of the node
            return False
        except HpcrunError:  # no answer within PROBE_S: what a lost node's slurmd gives
            return True

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(step_nodes) or 1)) as pool:
        return [n for n, gone in zip(step_nodes, pool.map(dead, step_nodes)) if gone]


def restart_nodes(spec: RunSpec, state: dict[str, tp.Any], step_nodes: list[str], allocated: list[str],
                  lost: list[str]) -> list[str] | None:
    """The nodes of the next start inside the job: the step's own in their order, less the lost and
    excluded ones, topped up from the job's other nodes (the hot spares); None when too few are left."""
    avoid = set(lost) | set(state.get("excluded_nodes") or []) | set(state.get("failed_nodes") or [])
    keep = [n for n in step_nodes if n not in avoid]
    spares = [n for n in allocated if n not in avoid and n not in keep]
    chosen = (keep + spares)[: spec.nodes]
    return chosen if len(chosen) == spec.nodes else None


def newest_checkpoint(run_dir: RunDir) -> int | None:
    """The step of the newest checkpoint directory (they become visible only when complete, by
    a rename); None when there is none. Read by name: this process imports no torch."""
    return max(step_dirs(run_dir.checkpoints), default=None)


def step_message(srun_stderr: str) -> str | None:
    """What srun or slurmstepd said of a step no task message explains: "CANCELLED DUE TO TIME
    LIMIT", or srun's last error line."""
    cancelled = list(STEP_CANCELLED.finditer(srun_stderr))
    if cancelled:
        return "CANCELLED" + (cancelled[-1]["why"] or "")
    errors = [line.strip() for line in srun_stderr.splitlines() if "error" in line.lower()]
    return errors[-1] if errors else None


def first_ranks(tasks: str) -> list[int]:
    out: list[int] = []
    for part in tasks.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def first_failure(srun_stderr: str, records: list[dict[str, tp.Any]]) -> Failure | None:
    """Which rank ended the attempt: srun's messages in the order the tasks ended, told apart
    from ranks that only saw a peer go; each rank's own record adds its error and step."""
    by_rank = {int(r["rank"]): r for r in records}
    candidates: list[Failure] = []
    for match in SRUN_ERROR.finditer(srun_stderr):
        what = match["what"].strip()
        code = re.fullmatch(r"Exited with exit code (\d+)", what)
        for rank in first_ranks(match["tasks"]):
            rec = by_rank.get(rank)
            if rec is not None:
                candidates.append(Failure(rank, match["node"], rec["error"], rec.get("step")))
            elif code:
                candidates.append(Failure(rank, match["node"], f"exit code {code[1]}", None))
            else:
                candidates.append(
                    Failure(
                        rank, match["node"], f"{what} ({SIGNAL_WORDS[what]})" if what in SIGNAL_WORDS else what, None
                    )
                )
    for rec in sorted(records, key=lambda r: r.get("time", 0)):  # ranks srun did not name
        if all(c.rank != rec["rank"] for c in candidates):
            candidates.append(Failure(int(rec["rank"]), rec.get("node"), rec["error"], rec.get("step")))
    causes = [c for c in candidates if not CONSEQUENCE.search(c.what)]
    found = causes or candidates
    return found[0] if found else None


def run_long(state: dict[str, tp.Any], job_id: str | None = None) -> dict[str, tp.Any]:
    """What state.json keeps across attempts: the run's nodes and slow ranks, and the counts of
    restarts inside `job_id` and of its requeues after a timeout while it is that job's."""
    kept = {k: state[k] for k in RUN_LONG if k in state}
    if job_id is not None and state.get("job_id") == job_id:
        kept.update({k: state[k] for k in (jobstate.IN_JOB, jobstate.TIMEOUTS) if state.get(k)})
    return kept


def rank_row(record: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The row a failing rank wrote into its exit record, with its times as datetimes again."""
    row = dict(record.get("row") or {})
    for key in ("start_time", "end_time"):
        if isinstance(row.get(key), str):
            row[key] = dt.datetime.fromisoformat(row[key])
    return row


def name_silent(run_dir: RunDir, job_id: str, restart: int, failure: Failure, record: dict[str, tp.Any] | None,
                world_size: int) -> Failure:
    """A hang (`record`: the rank that saw it first) with the ranks whose process had stopped when
    it fired, read from their heartbeats here, once for the attempt (hpcrun.runtime.heartbeat),
    and told on stderr with how long each was silent."""
    if record is None or failure.what != HUNG:
        return failure
    found = heartbeat.silent(run_dir, job_id, restart, world_size, float(record.get("time") or 0), skip=failure.rank)
    if not found:
        return failure
    print(f"[hpcrun] silent ranks: {'; '.join(found)}", file=sys.stderr)
    return dataclasses.replace(failure, what=f"{HUNG}; silent: {heartbeat.short(found)}")


def write_exit_record(
    run_dir: RunDir, job_id: str, restart: int, rank: int, error: str, step: int, row: dict[str, tp.Any],
    final: bool = False,
) -> None:
    """A failing rank's word, for the one writer of the attempt's record. `final`: the error is
    the run's outcome (a function job's call raised), which no restart or requeue changes."""
    import time

    record = {
        "rank": rank,
        "node": os.environ.get("SLURMD_NODENAME"),
        "error": error,
        "step": step,
        "time": time.time(),
        "row": row,
        "final": final,
    }
    write_json(run_dir.exit_record(job_id, restart, rank), json.loads(json.dumps(record, default=str)))


def record_failed_step(run_dir: RunDir, step_status: int, srun_stderr: str) -> str | None:
    """The failed attempt's one results row and state, and the requeue when the cap allows and
    the failure is not the previous attempt's again. Returns the reason (None: already recorded
    by a rank, e.g. a stop for requeue or the cap)."""
    from hpcrun.results import write_attempt

    spec = RunSpec.model_validate(read_json(run_dir.spec, None))
    job_id, restart, requeues = job_ids()
    records = [r for r in (read_json(p, None) for p in run_dir.exit_records(job_id, restart)) if isinstance(r, dict)]
    failure = first_failure(srun_stderr, records)
    if failure is None:
        failure = Failure(None, None, step_message(srun_stderr) or f"status {step_status}", None)
    own = next((r for r in records if r.get("rank") == failure.rank), None)
    failure = name_silent(run_dir, job_id, restart, failure, own, spec.world_size)
    final = bool(own.get("final")) if own else any(r.get("final") for r in records)
    signature = failure.signature(newest_checkpoint(run_dir))
    said = rank_row(own or next(iter(records), None) or {})
    step_nodes = [n for n in os.environ.get("HPCRUN_STEP_NODES", "").split(",") if n]
    row = {**plan_row(spec, job_id, restart, ",".join(step_nodes) or os.environ.get("SLURM_JOB_NODELIST")), **said}
    cap = spec.recipe.checkpoint.max_requeues
    in_job = int(os.environ.get("HPCRUN_RESTARTS_IN_JOB") or 0)
    next_file = os.environ.get("HPCRUN_NEXT_NODES")
    may_restart = bool(next_file) and in_job < spec.recipe.fault.restarts_in_job
    try:  # SLURM's tools may not answer: the attempt is recorded all the same
        lost = lost_step_nodes(step_nodes, srun_stderr)  # also for a requeue: the next start excludes it
        allocated = (
            hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) if may_restart and spec.spare_nodes else step_nodes
        )
        room = partition_size(spec.partition) if lost and spec.recipe.fault.exclude_failed_nodes else 0
    except HpcrunError as exc:
        print(f"[hpcrun] looking for lost nodes: {exc.format_message()}", file=sys.stderr)
        lost, allocated, room = [], step_nodes, 0
    if lost:
        failure = dataclasses.replace(failure, what=f"{failure.what}; node lost: {','.join(lost)}")
    decided: dict[str, tp.Any] = {}

    def merge(state: dict[str, tp.Any]) -> dict[str, tp.Any] | None:
        # decided under state.json's lock, against what is there now
        if (state.get("job_id"), state.get("restart_count")) == (job_id, restart):
            decided["requeue"] = state.get("status") in (REQUEUEING, "requeued")  # rank 0 said so, then was killed
            return None
        previous = (
            state.get("failure") if (state.get("job_id"), state.get("restart_count")) == (job_id, restart - 1) else None
        )
        reason = failure.describe()
        long = run_long(state, job_id)
        if lost:
            long["failed_nodes"] = sorted(set(state.get("failed_nodes") or []) | set(lost))
            long["excluded_nodes"] = exclusions(state, lost, room, spec.nodes)
        nodes = restart_nodes(spec, state, step_nodes, allocated, lost) if may_restart and not final else None
        if final:
            reason += "; the call's own error, its result: not run again"
        elif signature == previous:
            reason += "; the same failure as the previous attempt (same step, same error): not requeued"
        elif nodes is not None:
            decided["restart"] = nodes
            reason += f"; {RESTARTING} ({in_job + 1} of {spec.recipe.fault.restarts_in_job})"
            if set(nodes) - set(step_nodes):
                reason += f" on {','.join(nodes)}"
        elif requeues >= cap:
            reason += f"; requeue cap reached ({cap} requeues)"
        else:
            decided["requeue"] = True
            reason += f"; {REQUEUEING}"  # until SLURM has (settle)
        decided["reason"] = reason
        # the row before the state, so whoever reads "failed" finds it (see attempt.finish)
        row.update(status="failed", reason=reason, end_time=dt.datetime.now(dt.timezone.utc))
        write_attempt(spec.results_dir, row)
        restarts = int(long.get(jobstate.IN_JOB) or 0) + (1 if "restart" in decided else 0)
        return {**long, "status": "failed", "reason": reason, "job_id": job_id, "restart_count": restart,
                "step": row.get("last_step"), "failure": signature, jobstate.IN_JOB: restarts}

    run_dir.update_state(merge)
    if decided.get("restart") and next_file:
        with open(next_file, "w") as out:  # the batch script starts the step again on these nodes
            out.write(",".join(decided["restart"]) + "\n")
    elif decided.get("requeue"):
        requeue(run_dir, job_id, restart, requeues)
    return decided.get("reason")


def requeue(run_dir: RunDir | None, job: str, restart: int, requeues: int | None = None, last_try: bool = True) -> None:
    """Requeue `job` after its attempt `restart`, unless SLURM is already doing so (preemption and
    NODE_FAIL requeue by themselves, and twice would count twice); then, while it is pending (the
    only time SLURM accepts it), exclude the nodes this run lost. SLURM holds a requeued job for
    the site's `AuthInfo=cred_expire` (120 s by default) before it may start again, so the
    exclusion lands before that. state.json then says what SLURM did (`settle`). A SLURM tool that
    fails is one line (HpcrunError); unless it was the `last_try`, the attempt stays REQUEUEING for
    the failure step, which tries again. `restart` is hpcrun's attempt number, `requeues` SLURM's
    count (the same unless the job restarted inside itself)."""
    try:
        why_not = _requeue(run_dir, job, restart if requeues is None else requeues)
    except HpcrunError as exc:
        if last_try:
            settle(run_dir, job, restart, f"not requeued: {exc.format_message()}")
        raise
    settle(run_dir, job, restart, why_not)


def _requeue(run_dir: RunDir | None, job: str, requeues: int) -> str | None:
    """None once the job is requeued, else why it is not."""
    shown = slurm.run(slurm.show_job(job))
    if shown.returncode != 0:
        raise HpcrunError(f"scontrol show job {job} failed: {one_line(shown)}")
    fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
    if int(fields.get("Restarts") or 0) > requeues:  # SLURM counts a requeue as it makes it
        return None
    if fields.get("JobState") != jobstate.RUNNING:  # cancelled, or ended by its batch shell
        return f"not requeued: the job is {fields.get('JobState') or 'gone'}"
    excluded = (run_dir.state().get("excluded_nodes") or []) if run_dir else []
    # Requeueing sends SIGTERM to every process of the job, this one included: ignored until
    # the exclusion is set (SIGKILL follows only after the cluster's KillWait). Not
    # `requeuehold` + `release`: killed in between, that would leave the job held for good.
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        done = slurm.run(slurm.requeue(job))
        if done.returncode != 0:
            raise HpcrunError(f"scontrol requeue {job} failed: {one_line(done)}")
        if excluded:
            update = slurm.run(slurm.exclude_nodes(job, list(excluded)))
            if update.returncode != 0:
                print(
                    f"[hpcrun] requeued {job}, but could not exclude {','.join(excluded)}: {one_line(update)}",
                    file=sys.stderr,
                )
    finally:
        signal.signal(signal.SIGTERM, previous)
    return None


def settle(run_dir: RunDir | None, job: str, restart: int, why_not: str | None) -> None:
    """state.json's attempt, recorded as going to be requeued (REQUEUEING, or a failure's reason
    ending in `; requeueing`), says what SLURM did: requeued, or stopped (resumable) and why not.
    So state.json never claims a requeue SLURM did not make."""
    if run_dir is None:
        return

    def merge(state: dict[str, tp.Any]) -> dict[str, tp.Any] | None:
        if (state.get("job_id"), state.get("restart_count")) != (job, restart):
            return None
        reason = state.get("reason") or ""
        if state.get("status") == REQUEUEING:
            if why_not:
                return {**state, "status": "stopped", "reason": f"{reason}; {why_not}"}
            return {**state, "status": "requeued"}
        if state.get("status") == "failed" and reason.endswith(f"; {REQUEUEING}"):
            return {**state, "reason": f"{reason.removesuffix(REQUEUEING)}{why_not or 'requeued'}"}
        return None

    run_dir.update_state(merge)


def one_line(out: tp.Any) -> str:
    """A failed SLURM tool's message, on one line."""
    text = (out.stderr or out.stdout or "").strip()
    return text.splitlines()[-1] if text else f"exit status {out.returncode}"


def sacct_attempts(allocation_id: str) -> list[tuple[str, str]]:
    """(state, node list) of each start of the job, oldest first (a requeue adds one)."""
    out = slurm.run(slurm.attempt_states(allocation_id))
    if out.returncode != 0:
        raise HpcrunError(f"sacct -j {allocation_id} failed: {one_line(out)}")
    return [tuple(line.split("|")[:2]) for line in out.stdout.splitlines() if "|" in line]  # type: ignore[misc]


def hostnames(node_list: str) -> list[str]:
    out = slurm.run(slurm.hostnames(node_list))
    return (out.stdout.split() if out.returncode == 0 else []) or [node_list]


def lost_nodes(node_list: str) -> list[str]:
    """Of a NODE_FAIL attempt's nodes, those SLURM holds down now (all of them when none is:
    the node came back before we asked)."""
    nodes = hostnames(node_list)
    answer = slurm.run(slurm.node_states(list(nodes)))
    out = answer.stdout if answer.returncode == 0 else ""  # unknown: every node of the attempt
    down = sorted(
        {
            n
            for n, st in (line.split()[:2] for line in out.splitlines() if line.strip())
            if st.startswith(("down", "drain", "fail"))
        }
    )
    return down or nodes


def partition_size(partition: str) -> int:
    out = slurm.run(slurm.show_partition(partition))
    found = re.search(r"TotalNodes=(\d+)", out.stdout) if out.returncode == 0 else None
    return int(found[1]) if found else 0  # unknown: no exclusion (it could leave too few nodes)


def exclusions(state: dict[str, tp.Any], nodes: list[str], room: int, needed: int) -> list[str]:
    """The run's excluded nodes with `nodes` added, as long as a partition of `room` nodes
    (0: unknown, or exclusion off) still has the job's `needed` beside them; else as they were."""
    excluded = list(state.get("excluded_nodes") or [])
    candidates = sorted(set(excluded) | set(nodes))
    return candidates if room - len(candidates) >= needed else excluded


def record_slow(run_dir: RunDir, spec: RunSpec, found: dict[str, float], nodes: list[str]) -> None:
    """Ranks named slow (hpcrun.runtime.straggler; `found`: "rank R on NODE" -> ratio), kept for
    the run in state.json for `hpcrun status`; with `fault.exclude_slow_nodes`, their `nodes`
    are excluded from the job's later attempts like failed ones. Rank 0's metrics writer calls
    it, off the training thread (it may ask SLURM for the partition's size)."""
    excluding = spec.recipe.fault.exclude_slow_nodes and spec.scheduler == "slurm"
    room = partition_size(spec.partition) if excluding else 0

    def merge(state: dict[str, tp.Any]) -> dict[str, tp.Any]:
        slow = {**(state.get("slow_ranks") or {}), **found}
        return {**state, "slow_ranks": slow, "excluded_nodes": exclusions(state, nodes, room, spec.nodes)}

    run_dir.update_state(merge)


def lost_attempt(run_dir: RunDir, spec: RunSpec, job_id: str, restart: int, requeues: int,
                 allocation_id: str) -> str | None:
    """At an attempt's start (rank 0): when the previous attempt ended without a word, because
    SLURM requeued the job after NODE_FAIL, record it (a results row, state.json's failed nodes)
    and decide which nodes later attempts exclude. Returns the recorded reason. `restart` is
    hpcrun's attempt number, `requeues` SLURM's count (sacct's record of each start)."""
    if requeues == 0 or restart == 0:
        return None

    def said(state: dict[str, tp.Any]) -> bool:
        return state.get("job_id") == job_id and int(state.get("restart_count", -1)) >= restart - 1

    if said(run_dir.state()):
        return None
    # the previous attempt's record by its place (one per start, oldest first), not as the
    # next-to-last: slurmdbd may not hold this attempt's own record yet
    starts = sacct_attempts(allocation_id)
    if len(starts) < requeues or starts[requeues - 1][0] != jobstate.NODE_FAIL:
        return None
    previous = starts[requeues - 1][1]
    lost = lost_nodes(previous)
    room = partition_size(spec.partition) if spec.recipe.fault.exclude_failed_nodes else 0
    reason = f"node lost (NODE_FAIL): {','.join(lost)}; requeued by SLURM"
    wrote = False

    def merge(state: dict[str, tp.Any]) -> dict[str, tp.Any] | None:
        # under state.json's lock: the failed and excluded nodes are added to what is there now
        nonlocal wrote
        if said(state):
            return None
        failed = sorted(set(state.get("failed_nodes") or []) | set(lost))
        excluded = exclusions(state, lost, room, spec.nodes)
        row = {**plan_row(spec, job_id, restart - 1, previous), "status": "failed", "reason": reason,
               "end_time": dt.datetime.now(dt.timezone.utc)}
        write_attempt(spec.results_dir, row)  # the row before the state (see attempt.finish)
        wrote = True
        return {**state, "status": "failed", "reason": reason, "job_id": job_id, "restart_count": restart - 1,
                "failed_nodes": failed, "excluded_nodes": excluded, "failure": None}

    from hpcrun.results import write_attempt

    run_dir.update_state(merge)
    return reason if wrote else None


def main(argv: list[str]) -> int:
    """`python -m hpcrun.runtime.failure RUN_DIR STATUS < SRUN_STDERR`, from the sbatch script.
    A state file it cannot read or a SLURM tool that fails is one line and exit status 1."""
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m hpcrun.runtime.failure RUN_DIR STATUS < SRUN_STDERR", file=sys.stderr)
        return 2
    srun_stderr = sys.stdin.buffer.read().decode(errors="replace")
    try:
        reason = record_failed_step(RunDir(argv[0]), int(argv[1]), srun_stderr)
    except HpcrunError as exc:
        print(f"[hpcrun] recording the failed attempt: {exc.format_message()}", file=sys.stderr)
        return 1
    if reason:
        print(f"[hpcrun] attempt failed: {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
