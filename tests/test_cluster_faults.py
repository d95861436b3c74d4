"""Real failures on the SLURM test cluster: a SIGKILLed rank, a SIGSTOPped (hung) rank, a job
that crashes at the same step every time (a lost node: tests/test_cluster_lost_node.py). Each job
lasts a bounded time (a pause per step), each test says what one record of the failed attempt must
hold, and each run that completes ends with the weights (sha256) of the same training never
interrupted."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import typing as tp
from pathlib import Path

import pytest

from tests import faults
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT
from tests.runs import baseline_weights, hpcrun, local_baseline, recipe, rows, run_dir_of, site_copy, state

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
# 30 steps at >= 0.4 s: >= 12 s of training, >= 8 s of it after the first checkpoint (step 10).
# Time, not steps, bounds these jobs: fewer steps with longer pauses cost this CPU less (a step
# of the 4 ranks is ~0.3 s of CPU, a checkpoint more; 60 steps at 0.2 s cost ~10 s more per
# attempt than these, over the dozen attempts of these files a minute of CI).
TRAINING = {"steps": 30, "lr": 0.003, "micro_batch": 2, "seq_len": 32}
CHECKPOINT = {"interval": 10, "max_requeues": 3, "export_final": True}
PAUSED = entrypoint_job(str(ROOT), 0.4)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The uninterrupted runs at world size 4 (these tests') and 2 (tests/test_cluster_requeue.py's
    time-limit test's and tests/test_cluster_lost_node.py's; tests.runs.local_baseline: each runs
    once, shared), training while the cluster jobs fail and requeue."""
    return {
        world: local_baseline(tmp_path_factory, world, training=TRAINING, checkpoint=CHECKPOINT) for world in (4, 2)
    }


def weights_of(baselines: dict[int, Path], world: int) -> str:
    return baseline_weights(baselines[world])


def records(job: str) -> list[str]:
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.split()] if out.stdout.strip() else []


def wait_done(run_dir: Path, timeout: float) -> dict[str, tp.Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (
            (run_dir / "state.json").exists()
            and state(run_dir).get("status") in ("completed", "failed")
            and not (state(run_dir).get("reason") or "").endswith("; requeued")
        ):
            job = state(run_dir)["job_id"]
            if records(job) and records(job)[-1] in ("COMPLETED", "FAILED"):
                return state(run_dir)
        time.sleep(1)
    raise AssertionError(
        f"{run_dir.name} did not finish: {state(run_dir) if (run_dir / 'state.json').exists() else 'no state'}"
    )


def wait_checkpoint(run_dir: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not any((run_dir / "checkpoints").glob("step-*")):
        time.sleep(0.2)
    assert any((run_dir / "checkpoints").glob("step-*")), "no checkpoint appeared"


def submit(tmp: Path, name: str, **extra: tp.Any) -> tuple[Path, str]:
    site = site_copy(tmp, "testcluster")
    rec = recipe(tmp, name, **{"job": PAUSED, "training": TRAINING, "checkpoint": CHECKPOINT, **extra})
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    return run_dir, json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]


def test_killed_rank_ends_the_attempt_once_and_the_job_completes(tmp_path: Path, baselines: dict[int, Path]) -> None:
    """SIGKILL to rank 3 of a 2-node x 2-rank job: every rank is gone within 30 s, the failed
    attempt has exactly one results row naming rank, node and signal, and the job requeues once
    and completes from its checkpoint."""
    two_nodes = {"nodes": 2, "gpus_per_node": 2, "time": "00:10:00"}
    run_dir, job = submit(tmp_path, "killed-rank", resources=two_nodes)
    wait_checkpoint(run_dir)
    faults.rank_pid(job, 3)  # all four ranks running
    assert faults.ranks_alive(job, 4) == [0, 1, 2, 3], faults.ranks_alive(job, 4)  # the check below can see a live rank
    node = faults.signal_rank(job, 3, signal.SIGKILL)
    killed = time.time()
    while faults.ranks_alive(job, 4) and time.time() - killed < 30:
        time.sleep(0.5)
    assert not faults.ranks_alive(job, 4), f"ranks alive 30 s after the kill: {faults.ranks_alive(job, 4)}"
    final = wait_done(run_dir, timeout=240)
    assert final["status"] == "completed" and final["restart_count"] == 1, final
    assert records(job) == ["REQUEUED", "COMPLETED"], records(job)  # one requeue, not one per rank
    table = rows(tmp_path, run_dir)
    failed = table[table.restart_count == 0]
    assert len(failed) == 1, failed[["status", "reason"]].to_string()
    reason = failed.iloc[0]["reason"]
    assert failed.iloc[0]["status"] == "failed" and f"rank 3 on {node}" in reason and "SIGKILL" in reason, reason
    assert len(table) == 2 and table[table.restart_count == 1].iloc[0]["status"] == "completed"
    assert (run_dir / "weights.sha256").read_text() == weights_of(baselines, 4)


def test_sigstopped_rank_ends_the_attempt_and_the_job_completes(tmp_path: Path, baselines: dict[int, Path]) -> None:
    """One rank of a 2-node x 2-rank job is SIGSTOPped with `fault.hang_timeout_s: 60`: the other
    ranks' watchdogs fire within 120 s, their stacks are in the run's logs, the job requeues
    and completes with the weights of an uninterrupted run."""
    resources = {"nodes": 2, "gpus_per_node": 2, "time": "00:10:00"}
    run_dir, job = submit(tmp_path, "hung", resources=resources, fault={"hang_timeout_s": 60})
    wait_checkpoint(run_dir)
    faults.signal_rank(job, 3, signal.SIGSTOP)
    stopped = time.monotonic()
    deadline = stopped + 150
    while time.monotonic() < deadline and records(job)[:1] != ["REQUEUED"]:
        time.sleep(1)
    ended = time.monotonic() - stopped
    assert records(job)[:1] == ["REQUEUED"], records(job)
    assert ended < 120 + 10, ended  # 60 s timeout, 1 s polling, srun's teardown
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*") if p.is_file())
    assert logs.count("hung: no step progress for 60 s") >= 2, logs[-3000:]  # every rank that can run
    assert "Thread" in logs and "silent ranks: rank 3 on" in logs, logs[-3000:]
    failed = [r for r in rows(tmp_path, run_dir).to_dict("records") if r["status"] == "failed"]
    assert (
        len(failed) == 1
        and "hung (no step progress" in failed[0]["reason"]
        and "silent: rank 3 on" in failed[0]["reason"]
    ), failed
    final = wait_done(run_dir, timeout=400)
    assert final["status"] == "completed", final
    assert (run_dir / "weights.sha256").read_text() == weights_of(baselines, 4)


def test_same_crash_twice_stops_before_the_cap(tmp_path: Path) -> None:
    """A bug at step 7 on the last rank: the second attempt fails the same way and the job
    stops there (not after max_requeues attempts), with the reason in `hpcrun status`."""
    run_dir, job = submit(
        tmp_path, "same-crash",
        job=faults.crash_entrypoint_job(str(ROOT), 0.05, crash_step=7),
        checkpoint={**CHECKPOINT, "max_requeues": 4},
    )
    final = wait_done(run_dir, timeout=480)  # two attempts' start-ups on a loaded CI machine: seen > 240 s
    assert final["status"] == "failed" and final["restart_count"] == 1, final
    assert "the same failure as the previous attempt" in final["reason"], final["reason"]
    assert "RuntimeError: deliberate bug at step 7" in final["reason"] and "rank 1" in final["reason"], final["reason"]
    assert records(job) == ["REQUEUED", "FAILED"], records(job)
    table = rows(tmp_path, run_dir)
    assert sorted(table.restart_count) == [0, 1] and set(table.status) == {"failed"}, table[
        ["restart_count", "status", "reason"]
    ]
    shown = hpcrun("status", "--site", str(site_copy(tmp_path, "testcluster")), run_dir.name).stdout
    assert "same failure" in shown, shown
