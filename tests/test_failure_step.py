"""The failure step's decision (hpcrun.runtime.failure.record_failed_step) off the cluster, on real
run directories and exit records: whose error is the call's result, and when a failure is the
previous attempt's again. The step's nodes all answer their probes: nothing is lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from submitit.core.utils import JobPaths

from hpcrun.plan import RunSpec, plan
from hpcrun.recipe import Recipe
from hpcrun.rundir import RunDir
from hpcrun.runtime.failure import record_failed_step, write_exit_record
from hpcrun.site import load_site

JOB = "77"
PEER_LEFT = "RuntimeError: [gloo] Connection closed by peer [10.0.0.1]:29500"


def function_run(tmp: Path) -> tuple[RunDir, RunSpec]:
    """A 2-rank function job's run directory on the test cluster, as planned and written."""
    recipe = Recipe.model_validate(
        {"name": "r", "job": {"kind": "function"}, "resources": {"nodes": 2, "gpus_per_node": 1, "partition": "spare"}}
    )
    spec = plan(load_site("testcluster"), recipe, "r.yaml", "run").model_copy(
        update={"run_dir": str(tmp / "run"), "results_dir": str(tmp / "results")}
    )
    run_dir = RunDir(tmp / "run")
    run_dir.path.mkdir()
    run_dir.spec.write_text(spec.model_dump_json())
    (tmp / "probes").write_text("node node1 0\nnode node2 0\ncontroller - 0\n")
    return run_dir, spec


def failure_step_env(monkeypatch: pytest.MonkeyPatch, tmp: Path, attempt: int) -> None:
    """What the batch script tells the failure step after attempt `attempt` (restarts in the job
    before it: `attempt`) on node1,node2."""
    for name, value in {
        "SLURM_JOB_ID": JOB, "HPCRUN_ATTEMPT": str(attempt), "SLURM_RESTART_COUNT": "0",
        "HPCRUN_RESTARTS_IN_JOB": str(attempt), "HPCRUN_STEP_NODES": "node1,node2", "HPCRUN_JOB_NODES": "node1,node2",
        "HPCRUN_PROBES": str(tmp / "probes"), "HPCRUN_NEXT_NODES": str(tmp / "next"),
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("SLURM_ARRAY_JOB_ID", "SLURMD_NODENAME"):
        monkeypatch.delenv(name, raising=False)


def results(run_dir: RunDir) -> list[Path]:
    """The task result pickles the failure step wrote where submitit's Job looks."""
    return [p for task in (0, 1) if (p := JobPaths(run_dir.logs, job_id=JOB, task_id=task).result_pickle).exists()]


def test_a_rank_killed_without_a_record_is_not_the_calls_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 was SIGKILLed (OOM): no exit record. Rank 1's call then raised because its peer had
    gone, and said so as the call's own error. The failure is rank 0's kill, which is not a call's
    result: the step starts again in the job and no task gets "another task's call raised"."""
    run_dir, _ = function_run(tmp_path)
    failure_step_env(monkeypatch, tmp_path, 0)
    write_exit_record(run_dir, JOB, 0, 1, PEER_LEFT, 3, {}, final=True)
    srun = "srun: error: node1: task 0: Killed\nsrun: error: node2: task 1: Exited with exit code 1\n"
    reason = record_failed_step(run_dir, 137, srun)
    assert reason and reason.startswith("rank 0 on node1: Killed (SIGKILL)"), reason
    assert "the call's own error" not in reason and "restarting in the job" in reason, reason
    assert (tmp_path / "next").read_text().strip() == "node1,node2"
    assert not results(run_dir)


def test_the_first_failing_ranks_own_raise_is_the_calls_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's call raised first (its own record says so); srun killed rank 0 after it: the
    call's error is the run's outcome, every task's result says it, nothing runs again."""
    run_dir, _ = function_run(tmp_path)
    failure_step_env(monkeypatch, tmp_path, 0)
    write_exit_record(run_dir, JOB, 0, 1, "ValueError: the call's own error", 3, {}, final=True)
    srun = "srun: error: node2: task 1: Exited with exit code 1\nsrun: error: node1: task 0: Killed\n"
    reason = record_failed_step(run_dir, 1, srun)
    assert reason and reason.startswith("rank 1 on node2: ValueError: the call's own error"), reason
    assert reason.endswith("the call's own error, its result: not run again"), reason
    assert not (tmp_path / "next").exists()
    assert len(results(run_dir)) == 2
