"""Training on through a lost node (`fault.min_nodes`) on the real SLURM test cluster: a 3-node x
2-rank job with no spare loses its last node (every process of it killed, slurmd too) and goes on
inside its one allocation on the two nodes left, with the same global batch: the four ranks left
take the six slices of every step by gradient accumulation. The loss of every step after the
shrink matches an uninterrupted 6-rank run's within the tolerance README states (the reduction
order differs), and so do the final weights (tests/test_snapshot.py shows the same check fail
without the accumulation). DDP resumes from the survivors' state; FSDP (full shard) and ZeRO-2,
whose lost ranks' shards of the last step are nowhere else, from their disk checkpoint, resharded
(DCP; DeepSpeed's universal checkpoint), the four ranks' uneven shares (2, 2, 1, 1 slices) padded to
the same number of reductions (Context.padding)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from hpcrun.render import SAVE_GRACE_S, STEP_GRACE_S
from hpcrun.rundir import RunDir
from hpcrun.slurm import PROBE_S
from tests import faults, pool, slurmstats
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT
from tests.runs import (
    STRATEGIES,
    baseline_weights,
    hpcrun,
    local_baseline,
    losses,
    recipe,
    rows,
    run_dir_of,
    site_copy,
    state,
)
from tests.test_cluster_faults import CHECKPOINT, TRAINING, records, wait_checkpoint, wait_done
from tests.test_cluster_in_job import PEERS_SEE_S, SHELL_GAP_S, attempt_starts, first_seen
from tests.test_snapshot import SHRINK_RTOL, SHRINK_WTOL  # README's tolerances, measured there

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

WORLD = 6


def failure_and_restart(job: str) -> tuple[slurmstats.Step, slurmstats.Step]:
    """The job's failure step (one task) and the shrunk attempt's training step (four) after it,
    from SLURM's accounting. Not the failed step's end: SLURM records the lost node's steps as
    ending with the job, or with the node's drop (RESIZING)."""
    steps = slurmstats.numbered_steps(job)
    found = [(step, after) for step, after in zip(steps, steps[1:]) if step.tasks == 1 and after.tasks == 4]
    assert len(found) == 1, steps
    return found[0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_a_lost_node_without_a_spare_shrinks_the_job(
    strategy: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # the uninterrupted run at world size 6, trained beside the job
    baseline = local_baseline(tmp_path_factory, WORLD, training=TRAINING, checkpoint=CHECKPOINT,
                              strategy=STRATEGIES[strategy])
    first, second = faults.NODES
    third = pool.spare_node()
    assert third, f"no third node in partition {pool.partition('spare')} (tests/cluster/testcluster.sh up)"
    site = site_copy(tmp_path, "testcluster")
    resources = {"nodes": 3, "gpus_per_node": 2, "time": "00:10:00", "partition": pool.partition("spare")}
    path = recipe(tmp_path, "shrink", job=entrypoint_job(str(ROOT), 0.4), training=TRAINING, checkpoint=CHECKPOINT,
                  resources=resources, fault={"min_nodes": 2, "warm_standby": True}, strategy=STRATEGIES[strategy])
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(path)))
    job = json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]
    assert "#SBATCH --no-kill" in (run_dir / "script.sh").read_text()
    wait_checkpoint(run_dir)  # step 10 on disk
    _, node = faults.rank_pid(job, 5, attempt=0)
    assert node == third, node  # ranks 4-5 on the last node; the batch script on the first
    try:
        faults.power_off(third)
        off = time.time()
        ran = [faults.rank_pid(job, rank, timeout=120, attempt=1, nodes=(first, second))[1] for rank in range(4)]
        final = wait_done(run_dir, timeout=300)
    finally:
        faults.power_on(third)
    assert ran == [first, first, second, second], ran
    assert final["status"] == "completed" and final.get("restarts_in_job") == 1, final
    # one job start: SLURM records dropping the lost node as RESIZING; never NODE_FAIL or REQUEUED
    assert records(job) in (["RESIZING", "COMPLETED"], ["COMPLETED"]), records(job)
    table = rows(tmp_path, run_dir).sort_values("attempt")
    failed, shrunk = table.iloc[0], table.iloc[1]
    assert f"node lost: {third}" in failed["reason"] and "on 2 of 3 nodes" in failed["reason"], failed["reason"]
    assert (failed["world_size"], shrunk["world_size"], shrunk["nodes"]) == (6, 4, 2), table[["world_size", "nodes"]]
    assert shrunk["global_batch"] == failed["global_batch"], table["global_batch"]
    first_step = int(shrunk["first_step"])
    stepped = attempt_starts(tmp_path, run_dir)[1][1]  # the end of the shrunk attempt's first step
    # fault -> the first step on 2 nodes (README): hpcrun's part bounded, the machine's printed. The peers see
    # the loss (gloo's closed connections, else the pulse ring's 5 s, looked at twice a second); the batch
    # script ends the step the step grace after (longer only while a survivor saves, up to the save grace),
    # runs the failure step, then the shrunk step. Not bounded: the Pythons starting (the failure step's,
    # the four ranks' importing torch, ZeRO-2's conversion), which CI's load stretched to 60 s in all
    seen = first_seen(run_dir, job, range(4))  # ranks 0-3: the survivors
    assert seen is not None, list(RunDir(run_dir).exit_records(job, 0))
    failure, restart = failure_and_restart(job)
    assert failure.began and failure.ended and restart.began
    print(f"\n[shrink] power off -> the first step on 2 nodes: {stepped - off:.1f} s (a peer saw it: "
          f"{seen - off:.1f} s; the failure step began {failure.began.timestamp() - off:.0f} s and took "
          f"{(failure.ended - failure.began).total_seconds():.0f} s; the shrunk step began "
          f"{restart.began.timestamp() - off:.0f} s); resumed at step {first_step} ({shrunk['resumed_from']}), "
          f"recomputed {shrunk['recomputed_steps']} step(s)")
    assert seen - off <= PEERS_SEE_S, f"the first peer saw the lost node {seen - off:.1f} s after"
    # sacct's times are whole seconds (up to 1 s off); the probes, begun with the grace, each end within
    # `timeout -k 2 PROBE_S` (the nodes' at once, then the controller's); DDP's survivors keep their state
    # first, within the save grace
    waits = STEP_GRACE_S + SAVE_GRACE_S if strategy == "ddp" else max(STEP_GRACE_S, 2 * (PROBE_S + 2))
    assert failure.began.timestamp() - seen <= waits + 2 * SHELL_GAP_S, (seen, failure)
    assert (restart.began - failure.ended).total_seconds() <= SHELL_GAP_S, (failure, restart)
    if strategy == "ddp":
        assert shrunk["resumed_from"] == "survivor" and shrunk["recomputed_steps"] <= 1, shrunk
    else:  # FSDP's periodic snapshots are shards of six ranks, DeepSpeed keeps none: the disk checkpoint
        on_disk = first_step >= CHECKPOINT["interval"] and first_step % CHECKPOINT["interval"] == 0
        assert shrunk["resumed_from"] == "disk" and on_disk, shrunk
    assert baseline_weights(baseline)  # the baseline, trained beside the job, has finished
    got, want = losses(run_dir), losses(baseline)
    assert len(got) == len(want) == TRAINING["steps"], (got, want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got[first_step:], want[first_step:]))
    print(f"[shrink] largest relative loss difference after the shrink: {worst:.2e}")
    assert worst <= SHRINK_RTOL, (got[first_step:], want[first_step:])
    mine = torch.load(RunDir(run_dir).final_weights, weights_only=True)
    theirs = torch.load(RunDir(baseline).final_weights, weights_only=True)
    weights = max(((mine[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-12)).item() for k in theirs)
    print(f"[shrink] largest relative weight difference: {weights:.2e}")
    assert weights <= SHRINK_WTOL, weights
    assert state(run_dir).get("failed_nodes") == [third], state(run_dir)
    # `hpcrun status` of the run says so below its row (progress.json, the shrunk attempt's last word)
    shown = hpcrun("status", "--site", str(site), run_dir.name).stdout
    assert "  training on 2 of 3 nodes since a lost node (4 of 6 ranks): the same global batch" in shown, shown
