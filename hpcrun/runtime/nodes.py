"""The run's nodes across its attempts: which are lost, which later attempts exclude (failed or
slow ones), and which a restart inside the job runs on (the step's own, topped up with spares).

A lost node takes its batch script with it; SLURM requeues the job (NODE_FAIL) and the next
attempt's start records the lost attempt from sacct (`lost_attempt`), and the node is excluded
from the job's later attempts (`fault.exclude_failed_nodes`; applied by hpcrun.runtime.requeue).
The run's nodes are kept in state.json (`failed_nodes`, `excluded_nodes`, `slow_ranks`).

Runs on the batch node after srun too: imports no torch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import typing as tp
from pathlib import Path

from hpcrun import jobstate, slurm
from hpcrun.errors import HpcrunError
from hpcrun.plan import RunSpec
from hpcrun.rundir import RunDir
from hpcrun.runtime.requeue import sacct_attempts
from hpcrun.runtime.row import plan_row


@dataclasses.dataclass(frozen=True)
class Probed:
    """The batch script's probes of a step it had to end (its lost tasks never reported)."""

    lost: list[str]
    """Nodes that ran no probe step while SLURM's controller answered: lost."""
    silent: list[str]
    """Nodes that ran none while the controller did not answer either (a busy slurmctld): not known
    lost, so not recorded as failed; a restart inside the job goes elsewhere where it can."""


def probed_nodes(step_nodes: list[str], srun_stderr: str, probes: Path | None) -> Probed:
    """What the batch script's probes (the file `probes`: `node NAME STATUS` per node and
    `controller - STATUS` (squeue of the job), each the exit status under `timeout`) say of the step's
    nodes. They run in the batch shell, beside SLURM's clients, as the failure step may run in a
    container without them. A probe that could not run or was stopped, or left no line, says nothing."""
    if slurm.SRUN_ENDED not in srun_stderr or probes is None:
        return Probed([], [])
    try:
        text = probes.read_text()
    except FileNotFoundError:
        return Probed([], [])
    statuses = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) == 3 and words[2].isdigit():
            statuses[(words[0], words[1])] = int(words[2])
    # 126, 127: no srun to run; 143: the probe itself was stopped (a preemption's SIGTERM): no word
    unanswered = [n for n in step_nodes if statuses.get(("node", n), 0) not in (0, 126, 127, 143)]
    if statuses.get(("controller", "-")) == 0:
        return Probed(unanswered, [])
    return Probed([], unanswered)


def restart_nodes(spec: RunSpec, state: dict[str, tp.Any], step_nodes: list[str], allocated: list[str],
                  avoid_now: list[str], least: int | None = None) -> list[str] | None:
    """The nodes of the next start inside the job: the step's own in their order, less those to
    avoid now (lost, silent) and the excluded ones, topped up from the job's other nodes (the hot
    spares) up to `spec.nodes`; None when fewer than `least` (default: all of them) are left."""
    avoid = set(avoid_now) | set(state.get("excluded_nodes") or []) | set(state.get("failed_nodes") or [])
    keep = [n for n in step_nodes if n not in avoid]
    spares = [n for n in allocated if n not in avoid and n not in keep]
    chosen = (keep + spares)[: spec.nodes]
    return chosen if len(chosen) >= (least or spec.nodes) else None


def hostnames(node_list: str) -> list[str]:
    """The hosts of a SLURM node list (`node[1-2]`), as SLURM expands it; the list itself when it cannot."""
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
    """The partition's node count; 0 when SLURM does not say."""
    total = slurm.partition_field(partition, "TotalNodes")
    return int(total) if total and total.isdigit() else 0  # unknown: no exclusion (it could leave too few nodes)


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


def lost_attempt(run_dir: RunDir, spec: RunSpec, job_id: str, attempt: int, slurm_requeues: int,
                 allocation_id: str) -> str | None:
    """At an attempt's start (rank 0): when the previous attempt ended without a word, because
    SLURM requeued the job after NODE_FAIL, record it (a results row, state.json's failed nodes)
    and decide which nodes later attempts exclude. Returns the recorded reason. `attempt` is
    hpcrun's attempt number, `slurm_requeues` SLURM's count (sacct's record of each start)."""
    if slurm_requeues == 0 or attempt == 0:
        return None

    def said(state: dict[str, tp.Any]) -> bool:
        return state.get("job_id") == job_id and int(state.get("attempt", -1)) >= attempt - 1

    if said(run_dir.state()):
        return None
    # the previous attempt's record by its place (one per start, oldest first), not as the
    # next-to-last: slurmdbd may not hold this attempt's own record yet
    starts = sacct_attempts(allocation_id)
    if len(starts) < slurm_requeues or starts[slurm_requeues - 1][0] != jobstate.NODE_FAIL:
        return None
    previous = starts[slurm_requeues - 1][1]
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
        row = {**plan_row(spec, job_id, attempt - 1, previous), "status": "failed", "reason": reason,
               "end_time": dt.datetime.now(dt.timezone.utc)}
        write_attempt(spec.results_dir, row)  # the row before the state (see attempt.finish)
        wrote = True
        return {**state, "status": "failed", "reason": reason, "job_id": job_id, "attempt": attempt - 1,
                "failed_nodes": failed, "excluded_nodes": excluded, "failure": None}

    from hpcrun.results import write_attempt

    run_dir.update_state(merge)
    return reason if wrote else None


CLEAR_S = 15
"""The longest the removal before a requeue may hold it (a node SLURM still lists but that no
longer answers): a requeue asked for at the time limit must come before the job's end."""

NODE_DIRS_ENV = "HPCRUN_NODE_DIRS"
"""The batch script's node-local directories of this job start (snapshots, NVMe), one a line."""


def clear_node_dirs(nodes: list[str]) -> str | None:
    """Remove this job start's node-local directories (NODE_DIRS_ENV) on `nodes`, before the job
    is requeued: once SLURM requeues it no step may start, so the batch script's own cleanup at
    its exit is refused, and a requeued job can land on other nodes. Returns what went wrong (None:
    nothing); a failure never stops the requeue."""
    dirs = [d for d in os.environ.get(NODE_DIRS_ENV, "").splitlines() if d]
    if not dirs or not nodes:
        return None
    count = str(len(nodes))
    cmd = ["srun", "--overlap", f"--nodelist={','.join(nodes)}", f"--nodes={count}", f"--ntasks={count}",
           "--ntasks-per-node=1", "rm", "-rf", "--", *dirs]
    try:
        out = slurm.run(cmd, timeout=CLEAR_S)
    except HpcrunError as exc:
        return exc.format_message()
    return None if out.returncode == 0 else f"srun exited {out.returncode}: {out.stderr.strip()[-300:]}"
