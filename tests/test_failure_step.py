"""The failure step's decision (hpcrun.runtime.failure.record_failed_step) off the cluster, on real
run directories and exit records: whose error is the call's result, and when a failure is the
previous attempt's again. The step's nodes all answer their probes: nothing is lost."""

from __future__ import annotations

import time
import typing as tp
from pathlib import Path

import pytest
from submitit.core.utils import JobPaths

from hpcrun.plan import RunSpec, plan
from hpcrun.recipe import Recipe
from hpcrun.rundir import RunDir
from hpcrun.runtime import failure
from hpcrun.runtime.failure import record_failed_step, write_exit_record
from hpcrun.site import load_site

JOB = "77"
PEER_LEFT = "RuntimeError: [gloo] Connection closed by peer [10.0.0.1]:29500"


def written_run(tmp: Path, site: str, recipe: dict[str, tp.Any]) -> tuple[RunDir, RunSpec]:
    """A run directory under `tmp` of `recipe` on `site`, as planned and written (its logs/ made)."""
    spec = plan(load_site(site), Recipe.model_validate({"name": "r", **recipe}), "r.yaml", "run").model_copy(
        update={"run_dir": str(tmp / "run"), "results_dir": str(tmp / "results")}
    )
    run_dir = RunDir(tmp / "run")
    run_dir.logs.mkdir(parents=True)
    run_dir.spec.write_text(spec.model_dump_json())
    return run_dir, spec


def function_run(tmp: Path) -> tuple[RunDir, RunSpec]:
    """A 2-rank function job's run directory on the test cluster."""
    run_dir, spec = written_run(tmp, "testcluster", {
        "job": {"kind": "function"}, "resources": {"nodes": 2, "gpus_per_node": 1, "partition": "spare"}})
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


def killed(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch, tmp: Path, attempt: int) -> str | None:
    """Attempt `attempt` ended by a SIGKILL of rank 1 (the kernel's OOM killer, a node's hiccup):
    no rank wrote an exit record. The failure step records it."""
    failure_step_env(monkeypatch, tmp, attempt)
    (tmp / "next").unlink(missing_ok=True)
    return record_failed_step(run_dir, 137, "srun: error: node2: task 1: Killed\n")


def test_unrelated_kills_between_disk_checkpoints_are_not_the_same_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restarts resume from in-memory snapshots; disk checkpoints may be half an hour apart, and
    here there is none yet. Two SIGKILLs with training between them are two failures, told
    apart by how far each attempt got (rank 0's progress.json and heartbeat); the same kill
    with no step past the previous attempt's is the same failure again, and the run stops."""
    from hpcrun import progress
    from hpcrun.runtime import heartbeat

    run_dir, _ = function_run(tmp_path)
    progress.write(run_dir.progress, 40, 1000, 2.5, None, 0.1, JOB, 0, None)
    reason = killed(run_dir, monkeypatch, tmp_path, 0)
    assert reason and reason.startswith("rank 1 on node2: Killed (SIGKILL)") and "restarting in the job" in reason
    # the next attempt resumed from a snapshot and got to step 90 before its own kill
    progress.write(run_dir.progress, 90, 1000, 2.4, None, 0.1, JOB, 1, None)
    reason = killed(run_dir, monkeypatch, tmp_path, 1)
    assert reason and "restarting in the job (2 of 5)" in reason, reason
    assert run_dir.state()["failure"] == {"error": "Killed (SIGKILL)", "resumed": None, "reached": 90,
                                          "detected": pytest.approx(time.time(), abs=60)}
    # the third got no step past 90 (its heartbeat: step index 89 done; progress.json is the
    # second attempt's, not its own): the same failure again
    heartbeat.write(run_dir, JOB, 2, 0, 89, 0.0)
    reason = killed(run_dir, monkeypatch, tmp_path, 2)
    assert reason and reason.endswith("the same failure as the previous attempt (same error, no step past it): "
                                      "not requeued"), reason
    assert not (tmp_path / "next").exists()


def test_how_far_the_peers_got_tells_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 killed without a record; rank 1 left one when its collective broke, with the step
    it was in and where its attempt resumed. Further than the previous attempt: a new failure;
    resumed from a snapshot and killed short of it after some steps: a new one too (progress);
    killed again at that very step: the same one."""
    run_dir, _ = function_run(tmp_path)
    srun = "srun: error: node1: task 0: Killed\nsrun: error: node2: task 1: Exited with exit code 1\n"
    for attempt, first, step, again in ((0, 0, 40, False), (1, 35, 60, False), (2, 55, 58, False), (3, 55, 58, True)):
        failure_step_env(monkeypatch, tmp_path, attempt)
        write_exit_record(run_dir, JOB, attempt, 1, PEER_LEFT, step, {"first_step": first, "last_step": step})
        reason = record_failed_step(run_dir, 137, srun)
        assert reason and reason.startswith("rank 0 on node1: Killed (SIGKILL)"), reason
        assert ("the same failure as the previous attempt" in reason) is again, (attempt, reason)
        said = {"error": "Killed (SIGKILL)", "resumed": first, "reached": step}
        assert {k: v for k, v in run_dir.state()["failure"].items() if k in said} == said


def test_the_failed_row_says_how_long_detection_took(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's heartbeat says its last step ended 30 s ago; rank 1, whose collective broke, says
    its own last step ended 12 s ago (the heartbeat is written every few seconds: the later one
    is the attempt's last progress) and that it noticed 8 s ago; rank 0 noticed 5 s ago. The row
    says 4 s of detection, and state.json when the failure was noticed (where the next attempt's
    restart begins). Killed at once, with no record: detection runs to the record itself."""
    from hpcrun.results import load
    from hpcrun.rundir import read_json, write_json
    from hpcrun.runtime import heartbeat

    run_dir, spec = function_run(tmp_path)
    failure_step_env(monkeypatch, tmp_path, 0)
    now = time.time()
    heartbeat.write(run_dir, JOB, 0, 0, 39, now - 30)
    for rank, stepped, noticed in ((1, now - 12, now - 8), (0, now - 20, now - 5)):
        write_exit_record(run_dir, JOB, 0, rank, PEER_LEFT, 40, {"first_step": 0, "last_step": 40}, stepped=stepped)
        path = run_dir.exit_record(JOB, 0, rank)
        write_json(path, {**read_json(path, None), "time": noticed})
    record_failed_step(run_dir, 1, "srun: error: node2: task 1: Exited with exit code 1\n")
    assert run_dir.state()["failure"]["detected"] == pytest.approx(now - 8)
    rows = load(spec.results_dir)
    assert rows["detect_s"].tolist() == [pytest.approx(4.0)]

    failure_step_env(monkeypatch, tmp_path, 1)
    heartbeat.write(run_dir, JOB, 1, 0, 59, now - 30)
    record_failed_step(run_dir, 137, "srun: error: node1: task 0: Killed\nsrun: error: node2: task 1: Killed\n")
    second = load(spec.results_dir).set_index("attempt").loc[1]
    recorded = second["end_time"].timestamp()
    assert second["detect_s"] == pytest.approx(recorded - (now - 30))
    assert run_dir.state()["failure"]["detected"] == pytest.approx(recorded)


def test_a_shorter_attempt_from_an_older_save_is_not_the_same_failure() -> None:
    """The review's case: an attempt killed at step 1000, the requeue resumed from disk at 400 and
    killed at 900 by the same words: it progressed 500 steps, so it is not a crash loop. Dying at
    the very step the last one did, or making no step at all, is."""
    previous = {"error": "Killed (SIGKILL)", "resumed": 0, "reached": 1000}
    assert not failure.same_again(previous, {"error": "Killed (SIGKILL)", "resumed": 400, "reached": 900})
    assert failure.same_again(previous, {"error": "Killed (SIGKILL)", "resumed": 400, "reached": 1000})
    assert failure.same_again(previous, {"error": "Killed (SIGKILL)", "resumed": 400, "reached": 400})
    assert failure.same_again(previous, {"error": "Killed (SIGKILL)", "resumed": 400, "reached": None})
    assert not failure.same_again(previous, {"error": "RuntimeError: boom", "resumed": 400, "reached": 1000})
    assert not failure.same_again({"error": "Killed (SIGKILL)"}, {"error": "Killed (SIGKILL)", "resumed": 4,
                                                                 "reached": 9})


def local_run(tmp: Path) -> tuple[RunDir, RunSpec]:
    """A 2-rank command job's run directory on this machine (`--site local`)."""
    return written_run(tmp, "local", {"job": {"kind": "command", "command": ["true"]},
                                      "resources": {"nodes": 1, "gpus_per_node": 2}})


def test_a_local_rank_killed_without_a_word_is_recorded(tmp_path: Path) -> None:
    """`--site local`: rank 1 is SIGKILLed (the OOM killer, a user's kill) and its peer ended by the
    controller (srun's --kill-on-bad-exit): no rank lived to record the attempt. The controller
    records it as the batch script's failure step would, or the run would have no end on disk (a
    test waiting on it waited out its timeout), and a local run is continued by `hpcrun resume`."""
    import subprocess
    import sys

    from hpcrun.results import load

    run_dir, spec = local_run(tmp_path)
    # rank 1 dies at once, rank 0 would run on (ended by the controller)
    run_dir.script.write_text('if [ "$RANK" = 1 ]; then kill -KILL $$; fi\nexec sleep 60\n')
    started = time.monotonic()
    ended = subprocess.run([sys.executable, "-m", "hpcrun.localjob", str(run_dir.path), "--ranks", "2",
                            "--time-s", "120", "--signal-lead-s", "10"], capture_output=True, text=True, timeout=60)
    assert ended.returncode == 256 - 9 and time.monotonic() - started < 50, ended  # exit(-9): rank 1 was SIGKILLed
    state = run_dir.state()
    assert state.get("status") == "failed" and state["attempt"] == 0, (state, ended.stdout, ended.stderr)
    assert state["reason"].startswith("rank 1 on ") and "Killed (SIGKILL)" in state["reason"], state
    assert state["reason"].endswith("; continue with hpcrun resume"), state
    row = load(tmp_path / "results", run_id=spec.run_id)
    assert list(row["status"]) == ["failed"] and list(row["reason"]) == [state["reason"]], row


def test_a_local_attempt_a_rank_recorded_keeps_its_record(tmp_path: Path) -> None:
    """A rank that recorded the attempt itself (a stop it saved for, or its own error) and then
    exited non-zero: the controller's record adds nothing, and changes nothing."""
    run_dir, _ = local_run(tmp_path)
    said = {"status": "stopped", "reason": "SIGUSR2 at step 4; continue with hpcrun resume", "job_id": "123",
            "attempt": 0, "step": 4}
    run_dir.update_state(lambda state: said)
    assert record_failed_step(run_dir, -9, "srun: error: host: task 0: Killed\n", ids=("123", 0, 0)) is None
    assert run_dir.state() == said
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").rglob("*.parquet"))
