"""Command jobs (a user's unchanged script) keep hpcrun's fault-tolerance promise: a stop signal
is forwarded, a script that exits after it is a stopped attempt (requeued on SLURM within the
cap, whatever its exit code), a script that ignores it is killed and stopped all the same, and
the next attempt resumes from what the script saved under HPCRUN_CHECKPOINT_DIR."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.runs import hpcrun, recipe, run_dir_of, site_copy, state, wait_for
from tests.test_fault_tolerance import ranks

pytestmark = pytest.mark.slow

STEPS = 40
STEP_DELAY_S = 0.5  # the job lasts >= 20 s on any CPU: time to signal it mid-way


def example(tmp_path: Path, name: str, **fields: object) -> Path:
    """jobs/command_train.py (the documented contract), sized by time."""
    job = {"kind": "command", "command": ["python", str(ROOT / "jobs" / "command_train.py"), "--steps", str(STEPS), "--step-delay-s", str(STEP_DELAY_S)]}
    return recipe(tmp_path, name, job=job, **fields)


def starts(run_dir: Path) -> list[int]:
    path = run_dir / "command-starts"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_stopped_command_resumes_where_it_saved(tmp_path: Path) -> None:
    """USR2 to the ranks of a local command job (as SLURM signals every task): the script saves
    and exits 0, the attempt is `stopped` (not `completed`), and `resume` continues from the
    saved step to the end."""
    began = time.monotonic()
    site = site_copy(tmp_path)
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(example(tmp_path, "cmd-stop"))))
    wait_for(lambda: starts(run_dir) == [0] and len(ranks(run_dir)) == 2, what="the script's start")
    time.sleep(3)
    for pid in ranks(run_dir):
        os.kill(pid, signal.SIGUSR2)
    wait_for(lambda: (run_dir / "state.json").exists(), what="the stop")
    stopped = state(run_dir)
    assert stopped["status"] == "stopped", stopped
    assert "SIGUSR2" in stopped["reason"]
    assert (run_dir / "checkpoints" / "command_train.pt").exists()
    assert not (run_dir / "command-ok").exists()
    hpcrun("resume", "--site", str(site), "--wait", run_dir.name)
    assert state(run_dir)["status"] == "completed", state(run_dir)
    first, resumed = starts(run_dir)
    assert first == 0 and 0 < resumed < STEPS, starts(run_dir)  # continued, not restarted
    assert (run_dir / "command-ok").read_text().strip() == "2"
    print(f"duration {time.monotonic() - began:.0f} s")


def test_command_ignoring_the_signal_is_killed_and_stopped(tmp_path: Path) -> None:
    """A script that ignores USR2 is killed after the grace (half the signal lead) and the
    attempt is stopped, not left running into the time limit."""
    began = time.monotonic()
    site = site_copy(tmp_path)
    script = "import signal,time; signal.signal(signal.SIGUSR2, signal.SIG_IGN); open('started','w').close(); time.sleep(120)"
    rec = recipe(tmp_path, "cmd-deaf", job={"kind": "command", "command": ["python", "-c", script], "workdir": "."}, checkpoint={"signal_lead_s": 10})  # a 5 s grace
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    wait_for(lambda: (tmp_path / "started").exists() and len(ranks(run_dir)) == 2, what="the script's start")
    signalled = time.monotonic()
    for pid in ranks(run_dir):
        os.kill(pid, signal.SIGUSR2)
    wait_for(lambda: (run_dir / "state.json").exists(), timeout=60, what="the stop")
    assert time.monotonic() - signalled < 30
    final = state(run_dir)
    assert final["status"] == "stopped" and "SIGUSR2" in final["reason"], final
    print(f"duration {time.monotonic() - began:.0f} s")


@pytest.mark.cluster
def test_command_job_usr2_requeues_and_resumes_on_the_cluster(tmp_path: Path) -> None:
    """`scancel --signal=USR2` to a 2-node command job: the example saves and exits, the run
    is requeued by hpcrun, resumes from its saved step and completes."""
    from tests.test_cluster_requeue import records, wait_done

    began = time.monotonic()
    site = site_copy(tmp_path, "testcluster")
    rec = example(tmp_path, "cmd-usr2", resources={"nodes": 2, "gpus_per_node": 2, "time": "00:10:00"}, checkpoint={"max_requeues": 2})
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    job = json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]
    deadline = time.time() + 120
    while starts(run_dir) != [0] and time.time() < deadline:
        time.sleep(0.5)
    assert starts(run_dir) == [0], "the script did not start"
    time.sleep(4)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    final = wait_done(run_dir, timeout=300)
    assert final["status"] == "completed" and final["restart_count"] == 1, final
    assert records(job) == ["REQUEUED", "COMPLETED"], records(job)
    first, resumed = starts(run_dir)
    assert first == 0 and 0 < resumed < STEPS, starts(run_dir)
    assert (run_dir / "command-ok").read_text().strip() == "4"
    print(f"duration {time.monotonic() - began:.0f} s")
