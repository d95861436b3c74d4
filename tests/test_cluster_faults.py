"""The same crash twice, on the SLURM test cluster: a job whose last rank fails at the same step
in every attempt stops after its second (a restart inside the job), with the reason, instead of
using up its restarts and requeues. Also the helpers the other fault files share (`submit`,
`wait_done`, `wait_checkpoint`, `records`, the training and its checkpoints): a SIGKILLed or
SIGSTOPped rank and a lost spare are tests/test_cluster_in_job.py's, a lost node
tests/test_cluster_lost_node.py's, a slow one tests/test_cluster_slow.py's."""

from __future__ import annotations

import json
import subprocess
import time
import typing as tp
from pathlib import Path

import pytest

from tests import faults
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT
from tests.runs import hpcrun, recipe, rows, run_dir_of, site_copy, state

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
# 30 steps at >= 0.4 s: >= 12 s of training, >= 8 s of it after the first checkpoint (step 10).
# Time, not steps, bounds these jobs: fewer steps with longer pauses cost this CPU less (a step
# of the 4 ranks is ~0.3 s of CPU, a checkpoint more; 60 steps at 0.2 s cost ~10 s more per
# attempt than these, over the dozen attempts of these files a minute of CI).
TRAINING = {"steps": 30, "lr": 0.003, "micro_batch": 2, "seq_len": 32}
CHECKPOINT = {"interval": 10, "max_requeues": 3, "export_final": True}
PAUSED = entrypoint_job(str(ROOT), 0.4)


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
        f"\n{diagnosis(run_dir)}"
    )


def wait_checkpoint(run_dir: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not any((run_dir / "checkpoints").glob("step-*")):
        time.sleep(0.2)
    assert any((run_dir / "checkpoints").glob("step-*")), f"no checkpoint appeared\n{diagnosis(run_dir)}"


def diagnosis(run_dir: Path) -> str:
    """For a run that did not get where a test waited: SLURM's word on its jobs' steps and on nodes
    not in service, and the end of each rank's messages (a failed test's only record of a CI run)."""
    def run(argv: list[str]) -> str:  # SLURM's word, or why there is none: never in place of the failure
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{argv[0]}: {e}"

    submitted = run_dir / "jobs.json"
    jobs = [j["job_id"] for j in json.loads(submitted.read_text())] if submitted.exists() else []
    steps = ["sacct", "-D", "-n", "-P", "-j", ",".join(jobs), "-o", "JobID,JobName,State,ExitCode,Start,End,NodeList"]
    said = [run(steps) if jobs else "no job submitted", run(["sinfo", "-h", "-R", "-o", "%N %T %E"])]
    for log in sorted((run_dir / "logs").glob("*_log.err")):
        said.append(f"-- {log.name}: " + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(said)


def submit(tmp: Path, name: str, **extra: tp.Any) -> tuple[Path, str]:
    site = site_copy(tmp, "testcluster")
    rec = recipe(tmp, name, **{"job": PAUSED, "training": TRAINING, "checkpoint": CHECKPOINT, **extra})
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    return run_dir, json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]


def test_same_crash_twice_stops_before_the_cap(tmp_path: Path) -> None:
    """A bug at step 7 on the last rank: the second attempt (a restart inside the job) fails the
    same way and the job stops there (not after its restarts and max_requeues attempts), with the
    reason in `hpcrun status`."""
    run_dir, job = submit(
        tmp_path, "same-crash",
        job=faults.crash_entrypoint_job(str(ROOT), 0.05, crash_step=7),
        checkpoint={**CHECKPOINT, "max_requeues": 4},
    )
    final = wait_done(run_dir, timeout=480)  # two attempts' start-ups on a loaded CI machine: seen > 240 s
    assert final["status"] == "failed" and final["attempt"] == 1, final
    assert "the same failure as the previous attempt" in final["reason"], final["reason"]
    assert "RuntimeError: deliberate bug at step 7" in final["reason"] and "rank 1" in final["reason"], final["reason"]
    assert records(job) == ["FAILED"], records(job)  # the second attempt was inside the job
    table = rows(tmp_path, run_dir)
    assert sorted(table.attempt) == [0, 1] and set(table.status) == {"failed"}, table[
        ["attempt", "status", "reason"]
    ]
    shown = hpcrun("status", "--site", str(site_copy(tmp_path, "testcluster")), run_dir.name).stdout
    assert "same failure" in shown, shown
