"""A lost node on the SLURM test cluster (a file of its own so that CI's pools run it beside
the other fault tests): every process of the node killed, SLURM requeues, the job finishes on the
other node with the weights of an uninterrupted run, and the node is recorded and excluded."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from hpcrun.rundir import RunDir, newest_checkpoint
from tests import faults
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT
from tests.runs import baseline_weights, hpcrun, local_baseline, rows, site_copy, state, wait_for
from tests.test_cluster_faults import CHECKPOINT, TRAINING, records, submit, wait_checkpoint, wait_done
from tests.test_fault_tolerance import checkpoint_after

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same training never interrupted at world size 2 (shared with test_cluster_faults.py)."""
    return local_baseline(tmp_path_factory, 2, training=TRAINING, checkpoint=CHECKPOINT)


def test_lost_node_is_recorded_and_excluded(tmp_path: Path, baseline: Path) -> None:
    """Every process of the node under a 1-node job, slurmd included, is SIGKILLed: SLURM
    requeues (NODE_FAIL), the job finishes on the other node, state.json and the results name
    the lost node, and after a later requeue (USR2) the job excludes it though it is back."""
    # 2.4 s per step: >= 72 s per attempt, for the node's loss to be noticed (SlurmdTimeout) and
    # the resumed attempt to be cut once more after its next checkpoint (>= 24 s of it left)
    run_dir, job = submit(tmp_path, "lost-node", job=entrypoint_job(str(ROOT), 2.4))
    wait_checkpoint(run_dir)
    _, node = faults.rank_pid(job, 0)
    other = next(n for n in faults.NODES if n != node)
    try:
        faults.power_off(node)
        faults.wait_down(node, timeout=90)
        # the resumed attempt runs on the other node; cut it once more (USR2) to see the exclusion
        _, resumed_on = faults.rank_pid(job, 0, timeout=180)
        assert resumed_on == other
        # the resumed attempt's rank 0 records the lost one as it starts
        wait_for(
            lambda: node in (state(run_dir).get("failed_nodes") or []) if (run_dir / "state.json").exists() else False,
            what="the lost node's record",
        )
        faults.power_on(node)
        newest = newest_checkpoint(RunDir(run_dir).checkpoints) or 0
        wait_for(lambda: checkpoint_after(run_dir, newest), what="a checkpoint of the resumed attempt")
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        deadline = time.time() + 60
        while (
            "ExcNodeList=" + node
            not in subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        ):
            assert time.time() < deadline, "the requeued job does not exclude the lost node"
            time.sleep(0.5)
        final = wait_done(run_dir, timeout=240)
    finally:
        faults.power_on(node)
    assert final["status"] == "completed" and final["attempt"] == 2, final
    assert final["failed_nodes"] == [node] and final["excluded_nodes"] == [node], final
    assert records(job)[:2] == ["NODE_FAIL", "REQUEUED"], records(job)
    out = subprocess.run(
        ["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "NodeList"], capture_output=True, text=True
    ).stdout.split()
    assert out[-1] == other, out  # the last attempt, with the node back, still not on it
    table = rows(tmp_path, run_dir)
    lost = table[table.attempt == 0]
    assert len(lost) == 1 and f"node lost (NODE_FAIL): {node}" in lost.iloc[0]["reason"], lost[["status", "reason"]]
    shown = hpcrun("status", "--site", str(site_copy(tmp_path, "testcluster")), run_dir.name).stdout
    assert f"excluding {node}" in shown, shown
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)

