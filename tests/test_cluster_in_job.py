"""Recovery inside the allocation on the real SLURM test cluster (fault.restarts_in_job,
resources.spare_nodes): a SIGKILLed rank, a hung rank and a lost node end the attempt, and the
batch script starts the training step again in the same job (sacct shows one attempt, no
REQUEUED); restarts exhausted fall back to a requeue. Each run ends with the weights (sha256) of
the same training never interrupted. Jobs are bounded by time (a pause per step)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import pytest
import yaml

from hpcrun import rundir
from hpcrun.rundir import RunDir
from hpcrun.runtime import failure
from hpcrun.slurm import SRUN_ENDED
from tests import faults, pool, slurmstats
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT
from tests.runs import (
    NO_SLURM_CONTAINER,
    STRATEGIES,
    baseline_weights,
    hpcrun,
    local_baseline,
    recipe,
    rows,
    run_dir_of,
    site_copy,
    state,
    wait_for,
)
from tests.test_cluster_faults import CHECKPOINT, TRAINING, records, wait_checkpoint, wait_done

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
PAUSED = entrypoint_job(str(ROOT), 0.4)
TWO_BY_TWO = {"nodes": 2, "gpus_per_node": 2, "time": "00:10:00"}
LOCAL_SCRATCH = Path(yaml.safe_load((ROOT / "sites" / "testcluster.yaml").read_text())["storage"]["local_scratch"])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run at world size 4 (shared with tests/test_cluster_faults.py's)."""
    return local_baseline(tmp_path_factory, 4, training=TRAINING, checkpoint=CHECKPOINT)


def submit(tmp: Path, name: str, environment: dict[str, tp.Any] | None = None, **extra: tp.Any) -> tuple[Path, str]:
    site = site_copy(tmp, "testcluster", **({"environment": environment} if environment else {}))
    fields = {"job": PAUSED, "training": TRAINING, "checkpoint": CHECKPOINT, "resources": TWO_BY_TWO, **extra,
              "fault": {"warm_standby": True, **extra.get("fault", {})}}  # hpcrun's default (tests/runs.py: off)
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(recipe(tmp, name, **fields))))
    return run_dir, json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]


def wait_gone(job: str, attempt: int, timeout: float = 30) -> float:
    """When the last rank of `attempt` left (polled)."""
    deadline = time.time() + timeout
    while faults.ranks_alive(job, 4, attempt=attempt) and time.time() < deadline:
        time.sleep(0.1)
    assert not faults.ranks_alive(job, 4, attempt=attempt), f"attempt {attempt} still has ranks after {timeout} s"
    return time.time()


def wait_ended(job: str, timeout: float = 120) -> None:
    """Until SLURM no longer lists the job (its batch script's exit has run)."""
    deadline = time.time() + timeout
    while time.time() < deadline and subprocess.run(
        ["squeue", "-h", "-j", job], capture_output=True, text=True
    ).stdout.strip():
        time.sleep(0.5)


def attempt_starts(tmp: Path, run_dir: Path) -> dict[int, tuple[int, float]]:
    """Each attempt's first recorded step and its end time (the per-step table)."""
    from hpcrun.steps import load_steps

    steps = load_steps(tmp / "results", run_id=run_dir.name)
    first = steps.sort_values("time").groupby("attempt").first()
    return {int(a): (int(r["step"]), r["time"].timestamp()) for a, r in first.iterrows()}


# The batch script's own work between the steps of a restart inside the job: from the failed
# training step's end to the failure step's start (the step's status read, SLURM's word on the job's
# nodes, srun's request for the step) and from the failure step's end to the next training step's
# start (the nodes it named read, the attempt's line written, srun's request). Bash and SLURM's
# clients only, one request to slurmctld each, so a loaded machine still runs each within a second.
# Not bounded here: the failure step's and the ranks' Python starting, on two loaded cores the
# machine's scheduling (10.2 s end to end in CI at a load of 15-18, 1-2 s quiet; the figure is
# benchmarks/fault_latency.py's, RESULTS.md §3b). sacct's times are whole seconds (up to 1 s off).
SHELL_GAP_S = 3
# A peer's detection of a dead or silent rank (its exit record says when): the dead rank's closed
# connections raise in gloo at once, else the pulse ring's peer_timeout_s (5 s), looked at twice a second
# from a thread that only waits, so a loaded machine delays it by far less than the 3 s allowed
PEERS_SEE_S = 5 + 0.5 + 3


def first_seen(run_dir: Path, job: str, ranks: tp.Container[int]) -> float | None:
    """When the first of `ranks` recorded a peer's failure in attempt 0 of `job` (unix time), or None."""
    said = [json.loads(path.read_text()) for path in RunDir(run_dir).exit_records(job, 0)]
    return min((r["time"] for r in said if r["rank"] in ranks), default=None)


def restart_steps(job: str, world: int = 4) -> list[tuple[int, int, int]]:
    """For each restart inside the job's first start, from SLURM's accounting (whole seconds): the
    failed training step's end to the failure step's start, the failure step's own time, its end
    to the next step of `world` tasks: the restart's own, or with a warm standby (which already
    runs) the next standby, which the batch script starts as it tells the waiting one to go. The
    failure step is the one-task step right before it (the watcher's probes come earlier)."""
    steps = sorted((s for s in slurmstats.job_steps(job) if s.start == 0 and s.id.isdigit()), key=lambda s: int(s.id))
    found = []
    for step, after in zip(steps, steps[1:]):
        if step.tasks != 1 or after.tasks != world:
            continue
        assert step.began and step.ended and after.began, steps
        # the failed training step: the last one begun before it that did not complete (SLURM may count a
        # step the watcher ended as ending after it: its killed tasks' end)
        failed = [s for s in steps if s.tasks == world and s.began and s.began <= step.began and s.state != "COMPLETED"]
        assert failed and failed[-1].ended, f"no failed training step before the failure step {step.id}: {steps}"
        found.append(tuple(int(t.total_seconds()) for t in (
            step.began - failed[-1].ended, step.ended - step.began, after.began - step.ended
        )))
    return found


def snapshot_step(run_dir: Path, job: str, ranks: list[tuple[int, str]]) -> int:
    """The newest step of which every rank's own in-memory snapshot is complete (its manifest),
    read in each rank's node-local scratch through the rank's own view of the filesystem (the
    node's tmpfs lives in its mount namespace: /proc/PID/root)."""
    newest = []
    for rank, (pid, node) in enumerate(ranks):
        scratch = Path(f"/proc/{pid}/root") / LOCAL_SCRATCH.relative_to("/")
        mine = rundir.snapshot_rank_dir(rundir.snapshot_job_dir(scratch, job, 0), run_dir.name, node, rank)
        steps = [s for s, path in rundir.step_dirs(mine).items() if rundir.manifest(path).exists()]
        newest.append(max(steps, default=0))
    return min(newest)


def replica_step(pid: int, run_dir: Path, job: str, node: str) -> int:
    """The newest step of which the first node (where `pid` runs) holds a complete copy of both
    of `node`'s ranks (2 and 3): what a restart after losing `node` can resume from."""
    scratch = Path(f"/proc/{pid}/root") / LOCAL_SCRATCH.relative_to("/")
    job_dir = rundir.snapshot_job_dir(scratch, job, 0)
    held = []
    for rank in (2, 3):
        copies = rundir.snapshot_rank_dir(job_dir, run_dir.name, faults.NODES[0], rank)
        held.append(max((s for s, p in rundir.step_dirs(copies).items() if rundir.manifest(p).exists()), default=0))
    return min(held)


def test_killed_rank_is_restarted_inside_the_job(tmp_path: Path, baseline: Path) -> None:
    """SIGKILL to rank 3 of a 2-node x 2-rank job: the step starts again in the same allocation
    (no REQUEUED in sacct), the batch script's own part of it within seconds whatever the load,
    the failed attempt's row names rank, node and signal, and the weights are those of an
    uninterrupted run. Snapshots an ended job left on its nodes (its batch shell killed before its
    exit ran) are swept by the next job there."""
    for node in faults.NODES:  # job 1 ended long ago
        leftover = tp.cast(Path, faults.node_scratch(node, LOCAL_SCRATCH)) / "hpcrun-1-0" / "run" / "rank-00000"
        leftover.mkdir(parents=True, exist_ok=True)
    # 0.8 s a step: the 20 steps past the checkpoint leave >= 16 s for the kill, and nothing else comes
    # between them: CI's load (25 runnable on 2 cores) twice spent them all before it (the job completed at
    # attempt 0, rank 3 killed at its end), once on the checks and the start of the process below
    run_dir, job = submit(tmp_path, "in-job-kill", job=entrypoint_job(str(ROOT), 0.8))
    wait_for(lambda: faults.ranks_alive(job, 4, attempt=0) == [0, 1, 2, 3], "attempt 0's four ranks", 240)
    # a process of the failed attempt slow to leave (as a rank freeing tens of GB of pinned memory
    # would be): the restarted ranks wait for it, and train only once it is gone. It runs on no
    # node, but the test cluster's nodes share this machine's pid namespace: every rank sees it
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              env={**os.environ, "SLURM_JOB_ID": job, "HPCRUN_ATTEMPT": "0"})
    try:
        wait_checkpoint(run_dir)
        node = faults.signal_rank(job, 3, signal.SIGKILL, attempt=0)
        gone = wait_gone(job, 0)  # every rank of the attempt gone within 30 s, not one requeue per rank
        faults.rank_pid(job, 0, timeout=60, attempt=1)
        launched = time.time()  # within 0.5 s (rank_pid's polling)
        log = next((run_dir / "logs").glob("*_0_log.err"))
        wait_for(lambda: "waiting for earlier attempts' processes" in log.read_text(), "rank 0's wait", 120)
        time.sleep(2)
    finally:
        holder.kill()
        holder.wait()
    released = time.time()
    final = wait_done(run_dir, timeout=240)
    assert final["status"] == "completed" and final["attempt"] == 1, final
    assert final.get("restarts_in_job") == 1, final
    assert records(job) == ["COMPLETED"], records(job)  # one job attempt: never back through the queue
    table = rows(tmp_path, run_dir)
    assert len(table) == 2 and len(table[table.attempt == 0]) == 1, table[["attempt", "status"]]
    failed = table[table.attempt == 0].iloc[0]
    assert failed["status"] == "failed" and f"rank 3 on {node}" in failed["reason"], failed["reason"]
    assert "SIGKILL" in failed["reason"] and "restarting in the job (1 of 5)" in failed["reason"], failed["reason"]
    first_step, stepped = attempt_starts(tmp_path, run_dir)[1]
    restarted = table[table.attempt == 1].iloc[0]
    # tier 0: the ranks that outlived rank 3 kept their last completed step; at most the step rank 3
    # died in is trained again (hpcrun.runtime.snapshotsurvivor)
    assert restarted["resumed_from"] == "survivor" and restarted["recomputed_steps"] <= 1, restarted
    # the restart was the warm standby's ranks (fault.warm_standby), started beside attempt 0, told to go
    told = [p.read_text().count("[hpcrun] standby: becoming attempt 1") for p in (run_dir / "logs").glob("*_log.err")]
    assert sorted(told) == [1] * 4, told
    assert stepped >= released and restarted["restart_wait_s"] >= 2, (stepped - released, restarted["restart_wait_s"])
    recorded = failed["end_time"].timestamp()  # the failure step's row
    gaps = restart_steps(job)
    assert len(gaps) == 1, gaps  # one restart: two training steps, the failure step between them
    (to_failure, failure_s, to_restart), = gaps
    print(
        f"\n[in-job restart] last rank gone -> new ranks started: {launched - gone:.1f} s (the failure step "
        f"wrote its row {recorded - gone:.1f} s after, the new ranks started {launched - recorded:.1f} s later); "
        f"batch script: failed step's end -> failure step {to_failure} s, failure step {failure_s} s, its end -> "
        f"next step {to_restart} s; attempt 0's last process gone -> first resumed step ({first_step}): "
        f"{stepped - released:.1f} s"
    )
    # the batch script's part of the restart, not the Python starts beside it (SHELL_GAP_S)
    assert max(to_failure, to_restart) <= SHELL_GAP_S, (
        f"the batch script took {to_failure} s from the failed step's end to the failure step, "
        f"{to_restart} s from the failure step's end to the next step (at most {SHELL_GAP_S} s each)"
    )
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)
    shown = hpcrun("status", "--site", str(site_copy(tmp_path, "testcluster")), run_dir.name).stdout
    lines = shown.splitlines()
    at = next(i for i, text in enumerate(lines) if text.startswith("RUN "))
    columns = dict(zip(lines[at].split(), lines[at + 1].split()))
    assert (columns["REQUEUES"], columns["IN-JOB"]) == ("0", "1"), shown
    # and, for one run, how it spaces its saves: the recipe's disk interval, snapshots by time
    assert any(text.startswith("  checkpoints every 10 steps (the recipe's)") for text in lines[at + 2:]), shown
    assert any(text.startswith("  snapshots every ") and "MTBF" in text for text in lines[at + 2:]), shown
    left = {node: faults.snapshot_dirs(node, "1", LOCAL_SCRATCH) for node in faults.NODES}
    assert not any(left.values()), f"an ended job's snapshots left on the nodes: {left}"


def test_hung_rank_is_restarted_inside_the_job(tmp_path: Path, baseline: Path) -> None:
    """A SIGSTOPped rank with hpcrun's defaults (no hang timeout set): the next rank of the pulse
    ring sees it silent within `fault.peer_timeout_s` and ends the attempt naming it, and the step
    starts again in the same job with identical weights. (The hang watchdog's own path, a live rank
    stuck waiting, is tests/test_watchdog.py's and tests/test_pulse.py's.)"""
    run_dir, job = submit(tmp_path, "in-job-hang")
    wait_checkpoint(run_dir)
    node = faults.signal_rank(job, 3, signal.SIGSTOP, attempt=0)
    stopped = time.time()
    faults.rank_pid(job, 0, timeout=120, attempt=1)
    restarted = time.time() - stopped
    final = wait_done(run_dir, timeout=300)
    assert final["status"] == "completed" and final.get("restarts_in_job") == 1, final
    assert records(job) == ["COMPLETED"], records(job)
    # Detection is hpcrun's own (PEERS_SEE_S): rank 0, after rank 3 in the ring, hears no pulse; its exit
    # record says when. The rest of the restart (srun's end of the step, the Python starts) is the
    # machine's: only the batch script's part is bounded
    said = [json.loads(path.read_text()) for path in RunDir(run_dir).exit_records(job, 0)]
    silent = f"{failure.PEER_SILENT}: rank 3 on {node}"  # the node as SLURM names it (not the host's own name)
    assert any(r["rank"] == 0 and r["error"] == silent for r in said), said
    fire = min(r["time"] for r in said if r["rank"] != 3) - stopped
    (to_failure, failure_s, to_restart), = restart_steps(job)
    print(
        f"\n[in-job hang] stop -> rank 0 saw rank 3 silent: {fire:.1f} s; stop -> new ranks: {restarted:.1f} s; "
        f"batch script: failed step's end -> failure step {to_failure} s, failure step {failure_s} s, its end -> "
        f"next step {to_restart} s"
    )
    assert fire <= PEERS_SEE_S, f"rank 0 saw the stop {fire:.1f} s after it"
    # rank 0 named rank 3 silent: the batch script ended the step then (ranks 1 and 2 wait in a collective
    # for rank 3), not once its grace was over (rundir.named_silent)
    said = next((run_dir / "logs").glob("*_0_log.err")).read_text()
    assert f"{SRUN_ENDED}: the pulse ring named a rank silent" in said, said[-3000:]
    assert max(to_failure, to_restart) <= SHELL_GAP_S, (to_failure, to_restart)
    table = rows(tmp_path, run_dir).sort_values("attempt").to_dict("records")
    failed = [r for r in table if r["status"] == "failed"]
    assert len(failed) == 1 and silent in failed[0]["reason"], failed
    assert "restarting in the job" in failed[0]["reason"], failed
    # rank 0's watchdog kept its last step before it ended the attempt, the others theirs as it went
    assert table[1]["resumed_from"] == "survivor" and table[1]["recomputed_steps"] <= 1, table[1]
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)


def test_restarts_in_job_exhausted_fall_back_to_a_requeue(tmp_path: Path, baseline: Path) -> None:
    """`fault.restarts_in_job: 1`: a second dead rank (after a new checkpoint, so not the same
    failure again) requeues the job, which still finishes with identical weights. The in-memory
    snapshots (every 2 steps) on both nodes are gone once the failed start's batch shell has
    exited, before SLURM starts the job again."""
    run_dir, job = submit(tmp_path, "in-job-exhausted", fault={"restarts_in_job": 1},
                          checkpoint={**CHECKPOINT, "memory_interval": 2})
    wait_checkpoint(run_dir)
    faults.signal_rank(job, 3, signal.SIGKILL, attempt=0)
    faults.rank_pid(job, 1, timeout=90, attempt=1)
    newest = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    deadline = time.time() + 120  # a checkpoint made by the restarted step
    while time.time() < deadline and not any(
        int(p.name.split("-")[1]) > newest for p in (run_dir / "checkpoints").glob("step-*")
    ):
        time.sleep(0.2)
    # what the requeue must not leave: complete snapshots on each node (its ranks' and its replicas)
    held = {node: faults.snapshots_complete(node, job, LOCAL_SCRATCH) for node in faults.NODES}
    assert all(held.values()), f"no complete snapshot on a node before the fault: {held}"
    faults.signal_rank(job, 1, signal.SIGKILL, attempt=1)
    deadline = time.time() + 120
    while time.time() < deadline and "REQUEUED" not in records(job):
        time.sleep(0.5)
    assert "REQUEUED" in records(job), records(job)
    # held in the queue while its nodes are looked at: the next start's ranks would remove the
    # snapshots too (hpcrun.runtime.snapshotsweep), and SLURM may start it again as soon as KillWait
    # has ended the failed start's last process (20 s, as long as AuthInfo's cred_expire hold here)
    subprocess.run(["scontrol", "hold", job], check=True, capture_output=True)
    try:
        # the failed start's batch shell gone, its EXIT trap run
        wait_for(lambda: not faults.job_pids(job), "the failed start's processes to end", 60,
                 lambda: faults.commands(faults.job_pids(job)))
        left = {node: faults.snapshot_dirs(node, job, LOCAL_SCRATCH, start=0) for node in faults.NODES}
        starts = (run_dir / rundir.STARTS / job).read_text().splitlines()
    finally:
        subprocess.run(["scontrol", "release", job], check=True, capture_output=True)
    assert len(starts) == 2, f"the job started again before its nodes were looked at: {starts}"
    assert not any(left.values()), f"snapshots left after the requeue: {left} (held before the fault: {held})"
    final = wait_done(run_dir, timeout=400)
    assert final["status"] == "completed" and final["attempt"] == 2, final
    assert records(job) == ["REQUEUED", "COMPLETED"], records(job)
    reasons = rows(tmp_path, run_dir).sort_values("attempt")["reason"].tolist()
    assert "restarting in the job" in reasons[0] and "requeue" in reasons[1], reasons
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)


def test_lost_node_is_replaced_by_a_spare(tmp_path: Path, baseline: Path) -> None:
    """`resources.spare_nodes: 1`: every process of the second training node killed (slurmd
    too), its node-local snapshots with it: the job goes on on the spare without a requeue, from
    the state the first node's ranks kept when they saw the loss (newer than the disk checkpoint
    and the replicas), the lost node is recorded, and the weights are those of an uninterrupted run.
    The ranks and the failure step run in a container without SLURM's clients: the batch shell
    probes the nodes and names the job's nodes for them."""
    spare = pool.spare_node()
    assert spare, f"no spare node in partition {pool.partition('spare')} (tests/cluster/testcluster.sh up)"
    resources = {**TWO_BY_TWO, "spare_nodes": 1, "partition": pool.partition("spare")}
    run_dir, job = submit(
        tmp_path, "in-job-spare", environment=NO_SLURM_CONTAINER, resources=resources,
        training={**TRAINING, "log_interval": 1}, checkpoint={**CHECKPOINT, "memory_interval": 2},
    )
    script = (run_dir / "script.sh").read_text()
    assert "apptainer exec /images/without-slurm.sif" in script, script
    wait_checkpoint(run_dir)  # step 10 on disk
    first, second = faults.NODES
    _, node = faults.rank_pid(job, 3, attempt=0)
    assert node == second, node  # ranks 2-3 on the second node; the batch script on the first
    pid, _ = faults.rank_pid(job, 0, attempt=0)
    deadline = time.time() + 120
    while time.time() < deadline and replica_step(pid, run_dir, job, second) <= 10:
        time.sleep(0.1)
    assert replica_step(pid, run_dir, job, second) > 10, "no replica newer than the disk checkpoint"
    try:
        faults.power_off(second)
        off = time.time()
        # where the restarted ranks run: the node (network namespace) each process lives in
        ran = [faults.rank_pid(job, rank, timeout=120, attempt=1, nodes=(first, spare))[1] for rank in range(4)]
        final = wait_done(run_dir, timeout=300)
    finally:
        faults.power_on(second)
    assert ran == [first, first, spare, spare], ran
    assert final["status"] == "completed" and final.get("restarts_in_job") == 1, final
    # one job start: SLURM records dropping the lost node as a RESIZING record of it, if it
    # drops the node before the job ends (SlurmdTimeout); never a NODE_FAIL, FAILED or REQUEUED
    assert records(job) in (["RESIZING", "COMPLETED"], ["COMPLETED"]), records(job)
    # recorded and excluded: the partition's size from the batch script's tool loop (no scontrol in the container)
    assert second in (state(run_dir).get("failed_nodes") or []), state(run_dir)
    assert state(run_dir).get("excluded_nodes") == [second], state(run_dir)
    failed = rows(tmp_path, run_dir).sort_values("attempt").iloc[0]
    assert f"node lost: {second}" in failed["reason"], failed["reason"]
    # detected by its peers (PEERS_SEE_S): hpcrun's own wait. The record itself waits for srun's end and
    # the failure step's start too (the machine's: printed)
    seen = first_seen(run_dir, job, (0, 1))
    assert seen is not None, list(RunDir(run_dir).exit_records(job, 0))
    recorded = failed["end_time"].timestamp() - off
    print(f"\n[lost node] power off -> a peer saw it: {seen - off:.1f} s; -> recorded: {recorded:.1f} s")
    assert seen - off <= PEERS_SEE_S, f"the first peer saw the lost node {seen - off:.1f} s after"
    # from the state the first node's ranks kept when they saw the loss, the lost node's ranks' files
    # sent to the spare: at most the interrupted step trained again
    restarted = rows(tmp_path, run_dir).sort_values("attempt").iloc[1]
    assert restarted["resumed_from"] == "survivor" and restarted["recomputed_steps"] <= 1, restarted
    log = next((run_dir / "logs").glob("*_0_log.err")).read_text()
    resumed = re.search(r"resumed from survivor snapshot \(step (\d+)\)", log)
    assert resumed and int(resumed[1]) > 10, log[-3000:]
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)
    # the job's end cleared the nodes it held then (SLURM had dropped the lost one)
    wait_ended(job)
    left = {node: faults.snapshot_dirs(node, job, LOCAL_SCRATCH) for node in (first, spare)}
    assert not any(left.values()), f"snapshots left after the job: {left}"


@pytest.fixture(scope="module")
def baseline_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run at world size 4 with FSDP (full shard)."""
    return local_baseline(tmp_path_factory, 4, training=TRAINING, checkpoint=CHECKPOINT, strategy=STRATEGIES["fsdp"])


def test_a_killed_fsdp_rank_resumes_from_the_last_step_it_completed(tmp_path: Path, baseline_fsdp: Path) -> None:
    """FSDP (full shard): a dead rank's shard of the last completed step is nowhere but in its own
    snapshot of that step, so tier 0 of a sharded state is a snapshot every step
    (`checkpoint.memory_interval: 1`). SIGKILL to rank 3 of 2 nodes x 2: the restart inside the job
    resumes from its node-local snapshots of the last step every rank completed, recomputing at
    most one step, not the disk interval's, with identical weights."""
    run_dir, job = submit(
        tmp_path, "in-job-fsdp-kill", training={**TRAINING, "log_interval": 1},
        checkpoint={**CHECKPOINT, "memory_interval": 1}, strategy=STRATEGIES["fsdp"],
    )
    wait_checkpoint(run_dir)  # step 10 on disk; the next at 20
    ranks = [faults.rank_pid(job, rank, attempt=0) for rank in range(4)]
    deadline = time.time() + 60
    while time.time() < deadline and snapshot_step(run_dir, job, ranks) <= 11:
        time.sleep(0.05)  # snapshots past the disk's on every rank's node
    os.kill(ranks[3][0], signal.SIGKILL)
    final = wait_done(run_dir, timeout=240)
    assert final["status"] == "completed" and final.get("restarts_in_job") == 1, final
    assert records(job) == ["COMPLETED"], records(job)
    said = next((run_dir / "logs").glob("*_0_log.err")).read_text()
    resumed = re.search(r"resumed from (\w+) snapshot \(step (\d+)\)", said)
    assert resumed and resumed[1] == "memory" and 10 < int(resumed[2]) < 20, said[-3000:]
    table = rows(tmp_path, run_dir)
    restarted = table[table.attempt == 1].iloc[0]
    print(f"\n[fsdp tier 0] {resumed[0]}; recomputed {restarted['recomputed_steps']} steps, restart "
          f"{restarted['restart_s']:.1f} s")
    assert restarted["resumed_from"] == "memory" and restarted["recomputed_steps"] <= 1, restarted
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline_fsdp)


def test_every_rank_killed_resumes_from_the_memory_snapshot(tmp_path: Path, baseline: Path) -> None:
    """SIGKILL of every rank of 2 nodes x 2 at once (the batch script alive), past the disk
    checkpoint: the restart inside the job resumes from each rank's own node's in-memory
    snapshot, recomputing at most `checkpoint.memory_interval` steps, not the disk interval's,
    with identical weights. (FSDP's ranks restore their shards from the same snapshots: the test above.)"""
    memory_interval = 2
    run_dir, job = submit(
        tmp_path, "in-job-all", training={**TRAINING, "log_interval": 1},  # every step in rank 0's log
        checkpoint={**CHECKPOINT, "memory_interval": memory_interval},
    )
    wait_checkpoint(run_dir)  # step 10 on disk; the next at 20
    log = next((run_dir / "logs").glob("*_0_log.out"))
    ranks = [faults.rank_pid(job, rank, attempt=0) for rank in range(4)]
    deadline = time.time() + 60
    while time.time() < deadline and (complete := snapshot_step(run_dir, job, ranks)) < 14:
        time.sleep(0.05)
    assert complete >= 14, complete
    for pid, _ in ranks:
        os.kill(pid, signal.SIGKILL)
    final = wait_done(run_dir, timeout=240)
    assert final["status"] == "completed" and final.get("restarts_in_job") == 1, final
    assert records(job) == ["COMPLETED"], records(job)
    before = log.read_text().partition("attempt 1 (requeues 0)")[0]  # rank 0's steps, then the restart's
    reached = max(int(m) for m in re.findall(r"step (\d+)/30", before))
    said = log.with_suffix(".err").read_text()  # the restart's word on where it resumed
    resumed = re.search(r"resumed from (\w+) snapshot \(step (\d+)\)", said)
    assert resumed and resumed[1] == "memory", said[-3000:]
    # from the newest snapshot every rank had complete when they died, so no more than an interval
    assert int(resumed[2]) >= complete and reached - int(resumed[2]) <= memory_interval, (reached, complete, resumed[0])
    assert 10 < int(resumed[2]) < 20, resumed[0]  # newer than the disk checkpoint
    table = rows(tmp_path, run_dir)
    assert table[table.attempt == 1].iloc[0]["resumed_from"] == "memory", table
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)
