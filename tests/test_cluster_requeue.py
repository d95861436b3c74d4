"""Requeue on the real SLURM test cluster: time limit, USR2, preemption, crash cap. Every
interrupted run, 2 nodes x 2 ranks (world size 4, where a reduction's order could change after a
restart), must end with the weights of an uninterrupted one, bit for bit."""

from __future__ import annotations

import json
import re
import subprocess
import time
import typing as tp
from pathlib import Path

import pytest

from tests import pool, slurmstats
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT
from tests.runs import (
    NO_SLURM_CONTAINER,
    baseline_weights,
    hpcrun,
    local_baseline,
    recipe,
    run_dir_of,
    site_copy,
    state,
    status,
    wait_for,
)
from tests.test_cluster_faults import CHECKPOINT, TRAINING  # one uninterrupted run serves both files
from tests.test_fault_tolerance import checkpoint_after

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Interrupted jobs are bounded by time, not by this CPU's speed: a pause after every step makes
# the 30 steps last at least 12 s, so after the first checkpoint (step 10) there are >= 8 s for
# a signal or a preemption to land. Baselines run the same training without the pause.
STEP_DELAY_S = 0.4
PAUSED = entrypoint_job(str(ROOT), STEP_DELAY_S)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("requeue")


TWO_NODES = {"nodes": 2, "gpus_per_node": 2, "time": "00:10:00"}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same training never interrupted, 4 ranks on this machine (tests.runs.local_baseline,
    shared with tests/test_cluster_faults.py), training while the cluster tests run."""
    return local_baseline(tmp_path_factory, 4, training=TRAINING, checkpoint=CHECKPOINT)


@pytest.fixture(scope="module")
def baseline_of_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same at 2 ranks (also tests/test_cluster_faults.py's)."""
    return local_baseline(tmp_path_factory, 2, training=TRAINING, checkpoint=CHECKPOINT)


def records(job: str) -> list[str]:
    """sacct's records of a job, one per start (requeues add records with -D)."""
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.split()] if out.stdout.strip() else []


# The batch shell's own work after a start's ranks are gone (its training step ended): reading the
# step's status, SLURM's word on the job's nodes (squeue), the failure step's and the EXIT trap's
# srun requests, which SLURM refuses at once for a job it is requeueing, and removing temporary files.
# Bash and SLURM's clients only, each one request to slurmctld: no Python starts and nothing waits
# for a rank, so a machine busy enough to take 11 s over the ranks' save (seen in CI) still runs it
# within a second or two. sacct's times are whole seconds (a difference is up to 1 s off). Before
# a7cd994 the shell stayed until KillWait's SIGKILL (20 s here): scancel retrying on the ending job.
SHELL_AFTER_RANKS_S = 5


def batch_ends(job: str, world: int) -> dict[str, tuple[str, str, int]]:
    """For each start of `job` that SLURM requeued or preempted, how its batch shell ended: the
    `.batch` step's state and exit code (`0:9`: SIGKILLed), and the seconds from the end of that
    start's last training step (its `world` tasks, the ranks, gone after their save) to the end of
    the batch step: the batch script's own work, apart from the ranks'."""
    ends: dict[str, tuple[str, str, int]] = {}
    every = slurmstats.job_steps(job)
    for start, state_ in enumerate(records(job)):
        steps = [s for s in every if s.start == start]
        batch = next((s for s in steps if s.id == "batch"), None)
        trained = [s.ended for s in steps if s.id.isdigit() and s.tasks == world and s.ended]
        if state_ in ("REQUEUED", "PREEMPTED") and batch and batch.ended and trained:
            outlived = (batch.ended - max(trained)).total_seconds()
            ends[f"{state_} {len(ends)}"] = (batch.state, batch.exit_code, int(outlived))
    return ends


def preemptor_ran(job: str) -> bool:
    """The higher-priority job that preempted a test's job ran: COMPLETED, or FAILED only because
    slurmd (22.05) purged its batch script as it launched it. That race is SLURM's own, seen once
    on a loaded node 0.6 s after the preempted job's step ended there: slurmd-<node>.log has
    `_handle_stray_script: Purging vestigial job script .../job<id>/slurm_script`, then execve()
    fails (exit 2). Any other end is a failure."""
    ended = records(job)
    if ended == ["COMPLETED"]:
        return True
    purged, script = "Purging vestigial job script /var/spool/slurmd/", f"/job{int(job):05d}/slurm_script"
    return ended == ["FAILED"] and any(purged in line and line.rstrip().endswith(script)
                                       for log in Path("/var/log/slurm").glob("slurmd-*.log")
                                       for line in log.read_text(errors="replace").splitlines())


def wait_done(run_dir: Path, timeout: float = 420) -> dict[str, tp.Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if status(run_dir) in ("completed", "failed"):
            job = state(run_dir)["job_id"]
            if records(job) and records(job)[-1] in ("COMPLETED", "FAILED"):
                return state(run_dir)
        time.sleep(2)
    raise AssertionError(
        f"{run_dir.name} did not finish: {state(run_dir) if (run_dir / 'state.json').exists() else 'no state'}"
    )


def wait_checkpoint(run_dir: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not any((run_dir / "checkpoints").glob("step-*")):
        time.sleep(0.2)
    assert any((run_dir / "checkpoints").glob("step-*")), "no checkpoint appeared"


def submit(shared: Path, name: str, environment: dict[str, tp.Any] | None = None, **extra: tp.Any) -> tuple[Path, str]:
    site = site_copy(shared, "testcluster", **({"environment": environment} if environment else {}))
    rec = recipe(
        shared, name, **{"job": PAUSED, "training": TRAINING, "checkpoint": CHECKPOINT, "resources": TWO_NODES, **extra}
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    return run_dir, json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]


def test_time_limit_requeues_until_done(shared: Path, baseline_of_two: Path) -> None:
    """A job whose work outlasts its 2-minute limit: USR2 ahead of the limit, save, requeue,
    until done; the result equals a run that was never cut. One rank on each of 2 nodes: every
    attempt starts anew, and 4 ranks' start-up on a loaded CI machine ate so much of each
    attempt's 60-90 s that 5 attempts once did not finish."""
    # with a 3.2 s pause per step, >= 96 s of training after ~15 s of start-up: past the 60-90 s where USR2 comes.
    # SLURM signals once the time left is at most the lead, checked every 30 s: with 2 minutes
    # and a 30 s lead, USR2 comes 60-90 s into each attempt (seen here)
    run_dir, job = submit(
        shared, "timelimit",
        resources={"nodes": 2, "gpus_per_node": 1, "time": "00:02:00"},
        # the most requeues a recipe may ask for: under a loaded CI machine an attempt's start-up
        # can eat half of its 60-90 s (seen: the cap of 3 reached once)
        checkpoint={**CHECKPOINT, "signal_lead_s": 30, "max_requeues": 4},
        job=entrypoint_job(str(ROOT), 3.2),
        # the baseline's ranks share 2 cores (1 thread each); alone on a namespace node (task/none:
        # every core), a rank would take 2, and a CPU matmul's sums split by thread count differ
        # in the last bit (seen: other weights with OMP_NUM_THREADS=2, same code)
        env={"OMP_NUM_THREADS": "1"},
    )
    final = wait_done(run_dir, timeout=600)
    assert final["status"] == "completed"
    starts = records(job)
    assert len(starts) >= 2 and starts[:-1] == ["REQUEUED"] * (len(starts) - 1), starts  # cut at least once
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline_of_two)


def test_usr2_then_preemption_requeue_once_each_and_complete_bit_identical(shared: Path, baseline: Path) -> None:
    """USR2 mid-way (hpcrun saves and requeues), then, mid-way through the resumed attempt, the
    higher-priority partition takes both nodes (GraceTime 0: USR2 and SIGTERM together; SLURM
    requeues, hpcrun does not requeue twice). One requeue each; the weights of an uninterrupted run.
    Each time the batch shell, which SLURM's SIGTERM reaches as it ends the start, exits by itself
    once its step has: it does not hold the requeue until KillWait's SIGKILL (20 s here; it did,
    scancel retrying on the ending job, before the batch shell's stop traps asked only of a running one)."""
    # 1.6 s per step: >= 48 s of training; the preemption comes after the resumed attempt's first
    # checkpoint (step 20), with >= 16 s of its training left
    # with hpcrun's default standby (tests/runs.py turns it off): the batch shell ends it as it ends
    run_dir, job = submit(shared, "usr2-preempted", job=entrypoint_job(str(ROOT), 1.6), fault={"warm_standby": True})
    wait_checkpoint(run_dir)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    wait_for(lambda: status(run_dir) == "requeued", what="the USR2 stop", timeout=120)
    stopped = state(run_dir)["step"]
    wait_for(lambda: checkpoint_after(run_dir, stopped), what="a checkpoint of the resumed attempt", timeout=240)
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", pool.partition("urgent"), "-N2", "-n4", "-o", "/dev/null", "--wrap", "sleep 2"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    final = wait_done(run_dir)
    assert final["status"] == "completed" and final["attempt"] == 2, final
    assert records(job) == ["REQUEUED", "PREEMPTED", "COMPLETED"], records(job)  # one requeue per interruption
    ended = batch_ends(job, 4)
    # the shell exits by itself once its step has ended, not by KillWait's SIGKILL, and soon: its
    # own work after the ranks' (their save is not in it), not the requeue's whole time
    assert len(ended) == 2 and all(state_ != "CANCELLED" and code != "0:9" for state_, code, _ in ended.values()), ended
    assert all(seconds <= SHELL_AFTER_RANKS_S for _, _, seconds in ended.values()), (
        f"a batch shell outlived its ranks by more than {SHELL_AFTER_RANKS_S} s: {ended}"
    )
    print(f"\n[requeue] each batch shell's end after its ranks' (whole seconds): {ended}")
    assert preemptor_ran(urgent.split(";")[0]), records(urgent.split(";")[0])
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)


def test_usr2_to_the_batch_shell_requeues_once_and_completes_bit_identical(shared: Path, baseline: Path) -> None:
    """`scancel --signal=USR2 --full` reaches the batch shell too (as `--batch`, a site's
    `--signal=B:USR2@N` or a wrapper would): the shell passes the stop to the ranks and waits, so
    the job is requeued once, never FAILED, and completes with an uninterrupted run's weights.
    state.json says `requeued` only once SLURM counts the requeue. (Before the fix: FAILED, batch
    step 0:12, while state.json said `requeued`.) The ranks run in a container without SLURM's
    clients: rank 0's requeue goes through the batch script's tool loop."""
    # 0.8 s per step: >= 16 s of training after the first checkpoint (step 10) for the stop
    run_dir, job = submit(shared, "usr2-batch-shell", NO_SLURM_CONTAINER, job=entrypoint_job(str(ROOT), 0.8))
    assert "apptainer exec /images/without-slurm.sif" in (run_dir / "script.sh").read_text()
    wait_checkpoint(run_dir)
    subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)
    deadline = time.time() + 420
    said = None  # what state.json first says of the stopped attempt, and SLURM's requeue count then
    while time.time() < deadline:
        ended = records(job)[-1:] in (["COMPLETED"], ["FAILED"], ["CANCELLED"])
        now = state(run_dir) if (run_dir / "state.json").exists() else {}
        if said is None and now.get("attempt") == 0 and now.get("status") in ("requeued", "stopped", "failed"):
            shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
            said = (now["status"], re.search(r"Restarts=(\d+)", shown)[1] if "Restarts=" in shown else shown)
        if ended:  # the runs' own word is written before their step, and so the job, ends
            break
        time.sleep(1)
    assert records(job) == ["REQUEUED", "COMPLETED"], (records(job), state(run_dir))  # one requeue, not FAILED
    # state.json agrees with SLURM: `requeued` once SLURM counts the requeue
    assert said is not None and said == ("requeued", "1"), said
    final = state(run_dir)
    assert final["status"] == "completed" and final["attempt"] == 1, final
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)


def test_crashing_job_stops_at_the_cap(shared: Path) -> None:
    """A job that crashes differently each attempt (its exit code counts SLURM's requeues) is
    requeued until the cap (`restarts_in_job: 0`: through the queue each time); one that repeats
    its failure exactly stops sooner."""
    crash = "import os; raise SystemExit(7 + int(os.environ.get('SLURM_RESTART_COUNT') or 0))"
    run_dir, job = submit(
        shared, "crash",
        job={"kind": "command", "command": ["python", "-c", crash]},
        checkpoint={**CHECKPOINT, "max_requeues": 2},
        fault={"restarts_in_job": 0},  # the requeue cap: restarts inside the job would keep SLURM_RESTART_COUNT
        resources={"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"},  # the cap needs no more: 3 attempts of 1 rank
    )
    final = wait_done(run_dir, timeout=300)
    assert final["status"] == "failed"
    assert "requeue cap reached (2 requeues)" in final["reason"]
    assert len(records(job)) == 3 and records(job)[-1] == "FAILED", records(job)
    status = hpcrun("status", "--site", str(site_copy(shared, "testcluster")), run_dir.name).stdout
    assert "FAILED" in status and "requeue cap" in status
