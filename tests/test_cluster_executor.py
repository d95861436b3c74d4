"""submitit's executor plugin (hpcrun.executor) on the real SLURM test cluster: a plain function on
two nodes, a throttled job array of seven calls, and a Checkpointable call interrupted by USR2
that continues from its own checkpoint after exactly one requeue."""

from __future__ import annotations

import subprocess
import time
import typing as tp
from pathlib import Path

import pytest
import submitit

from hpcrun.rundir import RunDir
from tests import functions, pool
from tests.runs import scale_site, site_copy, wait_for
from tests.test_cluster_requeue import records

pytestmark = pytest.mark.cluster


def executor(tmp_path: Path) -> submitit.AutoExecutor:
    return submitit.AutoExecutor(tmp_path / "submitit", cluster="hpcrun",
                                 hpcrun_site=str(site_copy(tmp_path, "testcluster")))


def test_a_function_on_two_nodes_returns_each_ranks_value(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    ex.update_parameters(nodes=2, tasks_per_node=1, timeout_min=5, name="where")
    job = ex.submit(functions.where, 7)
    assert isinstance(job, submitit.SlurmJob)
    results = job.results()  # one value per task, as submitit gives them
    assert [(r["x"], r["rank"], r["world"], r["env_rank"], r["env_tasks"]) for r in results] == [
        (7, 0, 2, 0, 2), (7, 1, 2, 1, 2)]
    assert sorted(r["node"] for r in results) == sorted(pool.nodes())
    assert {r["master"] for r in results} == {pool.nodes()[0]}  # the template's rendezvous on the first node
    # submitit's TorchDistributedEnvironment sees the same rendezvous and ranks
    assert [r["torch_env"][:1] + r["torch_env"][2:] for r in results] == [
        (pool.nodes()[0], 0, 2, 1), (pool.nodes()[0], 1, 2, 1)]
    assert job.task(1).result()["rank"] == 1 and results[0]["job_id"] == job.job_id
    # a run like any other: its directory holds the rendered script that ran, and a completed attempt
    run_dir = RunDir(job.paths.folder.parent)
    assert run_dir.script.read_text().count("#SBATCH --nodes=2") == 1
    assert run_dir.state()["status"] == "completed"  # recorded before the values were written
    assert "rank 1/2" in (job.task(1).stdout() or "")
    assert job.done()


def test_map_array_runs_seven_calls_at_most_two_at_once(tmp_path: Path) -> None:
    """Seven calls, two at a time: more calls than the limit, so SLURM must hold some back
    (twenty at three proved nothing more, at three times the job starts)."""
    ex = executor(tmp_path)
    ex.update_parameters(nodes=1, tasks_per_node=1, timeout_min=5, hpcrun_array_parallelism=2)
    jobs = ex.map_array(functions.square, range(7), [0.5] * 7)
    assert len({job.job_id.split("_")[0] for job in jobs}) == 1  # one array
    script = RunDir(_run_dir_of(jobs[0])).script.read_text()  # every task's run holds the array's script
    assert "#SBATCH --array=0-6%2" in script, script
    assert [job.result() for job in jobs] == [x * x for x in range(7)]
    spans = []
    for job in jobs:
        times = dict(line.split() for line in (job.stdout() or "").splitlines() if line.startswith(("start ", "end ")))
        spans.append((float(times["start"]), float(times["end"])))
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)  # calls running as one starts
    assert 1 <= most <= 2, spans


def _run_dir_of(job: submitit.Job[int]) -> Path:
    """An array task's run directory: where its submitted pickle (a link) points."""
    return job.paths.submitted_pickle.resolve().parent


def stop_after_three_steps(job: submitit.Job[tp.Any], progress: Path, timeout: float) -> float:
    """USR2 to the job once the call has counted past 3 (its `progress` file); when it was sent."""
    wait_for(lambda: progress.exists() and progress.read_text() not in ("", "1", "2", "3"), "the call's 4th step",
             timeout)
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)
    return time.monotonic()


def test_a_checkpointable_call_resumes_from_its_checkpoint_after_one_requeue(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    ex.update_parameters(nodes=1, tasks_per_node=1, timeout_min=5)
    progress = tmp_path / "progress"
    job = ex.submit(functions.Counter(), 30, 0.2, str(progress))
    started = stop_after_three_steps(job, progress, 120)
    result = job.result()
    assert result["done"] == 30
    assert result["resumed_from"] is not None and 4 <= result["resumed_from"] < 30, result
    assert result["requeues"] == ["0", "1"], result  # SLURM_RESTART_COUNT of each attempt
    wait_for(lambda: records(job.job_id)[-1:] == ["COMPLETED"], "sacct's record of the job", 60)
    assert records(job.job_id) == ["REQUEUED", "COMPLETED"]
    assert time.monotonic() - started < 120


def test_a_call_that_raises_runs_once_and_its_error_is_the_result(tmp_path: Path) -> None:
    """An exception from the call is its outcome: no requeue and no restart in the job (which this
    run allows for faults: restarts_in_job 2), the job ends FAILED and the call ran once."""
    ex = executor(tmp_path)
    ex.update_parameters(nodes=1, tasks_per_node=1, timeout_min=5, hpcrun_recipe={"fault": {"restarts_in_job": 2}})
    ran = tmp_path / "ran"
    job = ex.submit(functions.append_and_raise, str(ran))
    with pytest.raises(submitit.core.utils.FailedJobError, match="the call's own error"):
        job.result()
    wait_for(lambda: records(job.job_id)[-1:] == ["FAILED"], "sacct's record of the job", 60)
    assert records(job.job_id) == ["FAILED"]  # never requeued
    state = RunDir(job.paths.folder.parent).state()
    assert state["status"] == "failed" and state["restarts_in_job"] == 0, state
    assert "ValueError: the call's own error" in state["reason"] and "not run again" in state["reason"], state
    assert ran.read_text().splitlines() == ["0"]


def test_a_stop_past_the_requeue_cap_is_the_calls_error(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    ex.update_parameters(nodes=1, tasks_per_node=1, timeout_min=5, hpcrun_recipe={"checkpoint": {"max_requeues": 0}})
    progress = tmp_path / "progress"
    job = ex.submit(functions.Counter(), 300, 0.2, str(progress))
    wait_for(lambda: progress.exists() and progress.read_text() not in ("", "1"), "the call's 2nd step", 120)
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)
    with pytest.raises(submitit.core.utils.FailedJobError, match="requeue cap reached"):
        job.result()
    wait_for(lambda: records(job.job_id)[-1:] == ["COMPLETED"], "sacct's record of the job", 60)
    assert records(job.job_id) == ["COMPLETED"]  # never requeued


def test_a_function_job_stopped_mid_collective_requeues(tmp_path: Path) -> None:
    """2 nodes x 2 ranks, rank r entering each all-reduce r x 0.3 s after rank 0: USR2 finds rank 0
    inside the collective, waiting for peers still pausing, which leave the call. No rank runs
    another collective on the call's group after the stop (before: one did, and the job hung
    until its time limit, TIMEOUT and no requeue); it is requeued once and the call continues
    from its checkpoint to the end."""
    ex = executor(tmp_path)
    ex.update_parameters(nodes=2, tasks_per_node=2, timeout_min=5)
    progress = tmp_path / "progress"
    job = ex.submit(functions.CollectiveCounter(), 60, 0.3, str(progress))
    started = stop_after_three_steps(job, progress, 180)
    results = job.results()  # one per rank
    assert [(r["done"], r["world"], r["requeues"]) for r in results] == [(60, 4, ["0", "1"])] * 4, results
    wait_for(lambda: records(job.job_id)[-1:] == ["COMPLETED"], "sacct's record of the job", 60)
    assert records(job.job_id) == ["REQUEUED", "COMPLETED"]
    assert time.monotonic() - started < 180  # the requeue hold, a start-up and the 56 calls left (<= 55 s)


@pytest.mark.scale  # minutes of waiting for a time limit: on the partition the scale tests leave idle after ~3 minutes
def test_max_num_timeout_counts_the_stop_at_the_time_limit_not_an_earlier_one(tmp_path: Path) -> None:
    """submitit's `max_num_timeout` against SLURM's own timing: a USR2 long before the time limit
    (as a preemption's stop) is requeued without counting; the USR2 SLURM sends at the signal lead
    before the limit is a timeout, and with max_num_timeout=0 it ends the run, the call's error saying so."""
    ex = submitit.AutoExecutor(tmp_path / "submitit", cluster="hpcrun", hpcrun_site=str(scale_site(tmp_path)))
    # SLURM sends the lead's USR2 120-150 s into a 3-minute start (it checks every 30 s); a stop
    # from 60 s on counts (hpcrun.runtime.timeouts: limit - lead - 90 s of slack)
    ex.update_parameters(nodes=1, tasks_per_node=1, timeout_min=3, hpcrun_signal_delay_s=30, hpcrun_max_num_timeout=0)
    progress = tmp_path / "progress"
    job = ex.submit(functions.Counter(), 100_000, 0.2, str(progress))
    wait_for(lambda: progress.exists() and progress.read_text() not in ("", "1"), "the call's 2nd step", 120)
    elapsed = subprocess.run(["squeue", "-h", "-j", job.job_id, "-o", "%M"], capture_output=True, text=True,
                             check=True, timeout=30).stdout.strip()
    minutes, _, seconds = elapsed.rpartition(":")  # squeue's M:SS under an hour
    assert minutes == "0" and int(seconds) < 45, f"the early stop would come {elapsed} in: too near 60 s to be early"
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)
    wait_for(lambda: records(job.job_id)[:1] == ["REQUEUED"], "the early stop's requeue", 120)
    with pytest.raises(submitit.core.utils.FailedJobError, match="timeout cap reached"):
        job.result()
    wait_for(lambda: records(job.job_id)[-1:] == ["COMPLETED"], "sacct's record of the job", 60)
    assert records(job.job_id) == ["REQUEUED", "COMPLETED"]  # the limit's stop was not requeued
    state = RunDir(job.paths.folder.parent).state()
    assert state["status"] == "failed" and "at the time limit" in state["reason"], state
