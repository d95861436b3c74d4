"""A slow node, for real: one rank throttled by the kernel (a CPU cgroup) is named with its node,
and with `fault.exclude_slow_nodes` the requeued job leaves that node out (hpcrun.runtime.straggler)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import faults
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT
from tests.runs import baseline_weights, hpcrun, local_baseline, rows, site_copy, state, wait_for
from tests.test_cluster_faults import CHECKPOINT, TRAINING, submit, wait_checkpoint, wait_done

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank run (tests.runs.local_baseline; tests/test_cluster_faults.py's too)."""
    return local_baseline(tmp_path_factory, 2, training=TRAINING, checkpoint=CHECKPOINT)


def test_slow_rank_is_named_and_its_node_excluded(tmp_path: Path, baseline: Path) -> None:
    """Rank 1 of a 1-node x 2-rank job is throttled by the kernel to a twentieth of a CPU (a slow
    node, for real): it is named with its node in state.json, `hpcrun status` and the attempt's
    results row; with `fault.exclude_slow_nodes` the job, requeued (USR2), leaves that node out
    and completes on the other with the weights of an uninterrupted run."""
    # probes as often as every 2.5 s (the default share spaces them ~16 s apart on these CPUs): named within the bound
    fault = {"straggler_factor": 2.0, "exclude_slow_nodes": True, "straggler_probe_share": 0.05}
    # The first attempt must still be training when the slow rank is named (up to 60 s below) and
    # USR2 comes: 3 s per step there, >= 84 s after its first checkpoint (step 2). At 0.8 s per step
    # (>= 16 s after step 10) CI once saw the job end before USR2 came, so it completed unrequeued.
    # The requeued attempt's steps take 0.8 s.
    run_dir, job = submit(tmp_path, "slow-rank", resources={"gpus_per_node": 2, "time": "00:10:00"},
                          fault=fault, metrics={"flush_seconds": 0.5}, checkpoint={**CHECKPOINT, "interval": 2},
                          job=entrypoint_job(str(ROOT), 0.8, first_attempt_delay_s=3.0))
    wait_checkpoint(run_dir)
    pid, node = faults.rank_pid(job, 1)
    other = next(n for n in faults.NODES if n != node)

    def named() -> bool:
        slow = state(run_dir).get("slow_ranks") if (run_dir / "state.json").exists() else None
        return bool(slow)

    # a twentieth, not a tenth: on a CI machine loaded ~6 runnable processes per core, an
    # unthrottled rank's probe took a fifth of a CPU's time, and a tenth was then not 2x slower
    # (measured: a twentieth was 2.3x or more at that load, 3.5x at half of it)
    with faults.throttled(pid, 0.05):
        wait_for(named, timeout=60, what="the slow rank's record")
    assert list(state(run_dir)["slow_ranks"]) == [f"rank 1 on {node}"], state(run_dir)
    assert state(run_dir)["excluded_nodes"] == [node], state(run_dir)
    assert not (run_dir / "weights.sha256").exists(), "the first attempt ended before it could be requeued"
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    final = wait_done(run_dir, timeout=240)
    assert final["status"] == "completed" and final["attempt"] == 1, final
    out = subprocess.run(
        ["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "NodeList"], capture_output=True, text=True
    ).stdout.split()
    assert out == [node, other], out
    first = rows(tmp_path, run_dir).query("attempt == 0").iloc[0]
    assert first["status"] == "requeued" and str(first["slow_ranks"]).startswith(f"rank 1 on {node} ("), first[
        ["status", "slow_ranks"]
    ]
    shown = hpcrun("status", "--site", str(site_copy(tmp_path, "testcluster")), run_dir.name).stdout
    # the throttled rank is named; under CI load an unthrottled rank may be named too (seen once)
    assert "slow: " in shown and f"rank 1 on {node} (" in shown and f"excluding {node}" in shown, shown
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)
