"""state.json claims a requeue only once SLURM has made it (hpcrun.runtime.requeue.requeue and
settle): a stop or a failure recorded as `requeueing` becomes `requeued` after `scontrol requeue`
succeeded or SLURM's requeue count shows its own requeue (preemption), else `stopped` (or the
failure's reason) with why not. `scontrol` is a stub at the process boundary (its answers only)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from hpcrun.errors import HpcrunError
from hpcrun.rundir import RunDir, write_json
from hpcrun.runtime.requeue import requeue

SCONTROL = """#!/bin/bash
echo "$*" >>"$FAKE_DIR/calls"
case "$1" in
  show) echo "JobId=55 JobName=x"; echo "   JobState=$FAKE_STATE Reason=None Dependency=(null)";
        echo "   Requeue=1 Restarts=$FAKE_RESTARTS BatchFlag=1 Reboot=0 ExitCode=0:0" ;;
  requeue) [ -z "$FAKE_REFUSE" ] || { echo "scontrol: error: $FAKE_REFUSE" >&2; exit 1; } ;;
esac
"""


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunDir:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(SCONTROL)
    (bindir / "scontrol").chmod(0o755 | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    (tmp_path / "run").mkdir()
    return RunDir(tmp_path / "run")


def attempt(run_dir: RunDir, status: str, reason: str, number: int = 0) -> None:
    write_json(run_dir.state_file, {"status": status, "reason": reason, "job_id": "55", "attempt": number,
                                    "excluded_nodes": []})


def scontrol(monkeypatch: pytest.MonkeyPatch, state: str, restarts: int, refuse: str = "") -> None:
    monkeypatch.setenv("FAKE_STATE", state)
    monkeypatch.setenv("FAKE_RESTARTS", str(restarts))
    monkeypatch.setenv("FAKE_REFUSE", refuse)


def calls(run_dir: RunDir) -> list[str]:
    path = run_dir.path.parent / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_a_requeue_slurm_made_is_recorded(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    attempt(run_dir, "requeueing", "USR2 at step 12")
    scontrol(monkeypatch, "RUNNING", 0)
    requeue(run_dir, "55", 0)
    assert calls(run_dir) == ["show job 55", "requeue 55"]
    assert run_dir.state()["status"] == "requeued" and run_dir.state()["reason"] == "USR2 at step 12"


def test_slurm_s_own_requeue_is_not_made_twice(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preempted: SLURM already counts the requeue (Restarts past this attempt's), job COMPLETING."""
    attempt(run_dir, "requeueing", "SIGTERM at step 12", number=1)
    scontrol(monkeypatch, "COMPLETING", 2)
    requeue(run_dir, "55", 1)
    assert calls(run_dir) == ["show job 55"]
    assert run_dir.state()["status"] == "requeued"


def test_a_job_that_ended_is_not_claimed_requeued(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch shell died (or scancel): the job completes with no requeue; the attempt stopped
    after saving, resumable."""
    attempt(run_dir, "requeueing", "USR2 at step 12")
    scontrol(monkeypatch, "COMPLETING", 0)
    requeue(run_dir, "55", 0)
    assert calls(run_dir) == ["show job 55"]
    state = run_dir.state()
    assert state["status"] == "stopped", state
    assert state["reason"] == "USR2 at step 12; not requeued: the job is COMPLETING", state


def test_a_refused_requeue_is_recorded_and_raised(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    attempt(run_dir, "failed", "rank 3 on node2: Killed (SIGKILL); requeueing")
    scontrol(monkeypatch, "RUNNING", 0, refuse="Requested operation is presently disabled")
    with pytest.raises(HpcrunError, match="scontrol requeue 55 failed"):
        requeue(run_dir, "55", 0)
    state = run_dir.state()
    assert state["status"] == "failed", state
    assert state["reason"] == ("rank 3 on node2: Killed (SIGKILL); not requeued: scontrol requeue 55 failed: "
                               "scontrol: error: Requested operation is presently disabled"), state


def test_another_attempt_s_state_is_left_alone(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    attempt(run_dir, "completed", "", number=1)
    scontrol(monkeypatch, "COMPLETING", 0)
    requeue(run_dir, "55", 0)
    assert json.loads(run_dir.state_file.read_text())["status"] == "completed"


def test_a_failed_first_try_is_left_to_the_failure_step(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's try (not the last): the attempt stays `requeueing`, which the failure step after
    srun reads as "requeue this" and tries again."""
    attempt(run_dir, "requeueing", "USR2 at step 12")
    scontrol(monkeypatch, "RUNNING", 0, refuse="Socket timed out on send/recv operation")
    with pytest.raises(HpcrunError):
        requeue(run_dir, "55", 0, last_try=False)
    assert run_dir.state()["status"] == "requeueing"
