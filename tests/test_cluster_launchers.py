"""The code people already have, on the real test cluster: an unchanged Lightning script
(jobs/lightning_train.py, launcher srun, 2 nodes x 2 ranks: Lightning's SLURM detection must see
the ranks of a node as its devices) and a torchrun-style script (jobs/command_train.py, launcher
torchrun, 2 nodes x 2 ranks). Each is sent USR2, then preempted by the
higher-priority partition: one requeue each (sacct -D), each attempt resuming from the script's
own checkpoint (its steps continue), and the job completes. And a Lightning job array whose
signalled task alone is requeued (1 node x 1 rank each: what is under test is the array, and
the 2 x 2 test above covers Lightning's ranks per node)."""

from __future__ import annotations

import json
import subprocess
import time
import typing as tp
from pathlib import Path

import pytest

from tests import pool
from tests.helpers import ROOT
from tests.runs import hpcrun, recipe, rows, run_dir_of, site_copy, state, wait_for
from tests.test_cluster_requeue import preemptor_ran, records, wait_done

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS = 60
STEP_DELAY_S = 0.4  # >= 24 s of training on any CPU: time to signal each attempt mid-way


def lightning_job(nodes: int, devices: int, steps: int = STEPS) -> dict[str, tp.Any]:
    script = str(ROOT / "jobs" / "lightning_train.py")
    return {
        "kind": "command",
        "command": [
            "python",
            script,
            "--steps",
            str(steps),
            "--nodes",
            str(nodes),
            "--devices",
            str(devices),
            "--step-delay-s",
            str(STEP_DELAY_S),
        ],
    }


TORCHRUN_JOB = {
    "kind": "command",
    "launcher": "torchrun",
    "command": [
        "python",
        str(ROOT / "jobs" / "command_train.py"),
        "--steps",
        str(STEPS),
        "--step-delay-s",
        str(STEP_DELAY_S),
    ],
}


def reported(run_dir: Path, job: str) -> list[list[int]]:
    """The steps each attempt's script reported to hpcrun (hpcrun.runtime.reported), by attempt."""
    attempts = []
    for attempt in range(10):
        path = run_dir / "reported" / f"{job}-{attempt}.jsonl"
        if not path.exists():
            break
        attempts.append([json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()])
    return attempts


def wait_reported(run_dir: Path, job: str, attempt: int, steps: int) -> None:
    """Until `attempt` has reported `steps` steps of its own: it started and trains."""
    wait_for(lambda: len(reported(run_dir, job)) > attempt and len(reported(run_dir, job)[attempt]) >= steps,
             what=f"attempt {attempt} of {job} to train {steps} steps", timeout=300)


def task_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*_log.out")))


def interrupt_twice(
    tmp_path: Path, name: str, job_fields: dict[str, tp.Any], ranks_per_node: int
) -> tuple[Path, str, list[list[int]]]:
    """Submit on 2 nodes; USR2 mid-way through the first attempt and a preemption mid-way
    through the second; return (run dir, job id, steps reported per attempt) once done."""
    site = site_copy(tmp_path, "testcluster")
    rec = recipe(
        tmp_path, name, job=job_fields, resources={"nodes": 2, "gpus_per_node": ranks_per_node, "time": "00:10:00"}
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    job = json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]
    wait_reported(run_dir, job, 0, 5)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    wait_reported(run_dir, job, 1, 5)
    urgent = (
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                "-p",
                pool.partition("urgent"),
                "-N2",
                "-n4",
                "-o",
                "/dev/null",
                "--wrap",
                "sleep 2",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    final = wait_done(run_dir, timeout=600)
    assert final["status"] == "completed" and final["attempt"] == 2, final
    # one requeue per signal: by hpcrun after USR2, by SLURM at the preemption; never also by Lightning
    assert records(job) == ["REQUEUED", "PREEMPTED", "COMPLETED"], records(job)
    assert preemptor_ran(urgent), records(urgent)
    attempts = reported(run_dir, job)
    assert len(attempts) == 3, attempts
    for before, after in zip(attempts, attempts[1:]):
        assert after[0] == before[-1] + 1, attempts  # resumed where the stopped attempt saved, not from 0
    assert attempts[0][0] == 1 and attempts[-1][-1] == STEPS, attempts
    table = rows(tmp_path, run_dir).sort_values("attempt")
    assert list(table["status"]) == ["requeued", "requeued", "completed"], table[["status", "reason"]]
    assert list(table["world_size"]) == [2 * ranks_per_node] * 3 and table["final_loss"].notna().all()
    assert list(table["last_step"]) == [a[-1] for a in attempts], (table["last_step"], attempts)
    return run_dir, job, attempts


def test_lightning_script_requeued_by_usr2_and_preemption_resumes_its_global_step(tmp_path: Path) -> None:
    began = time.monotonic()
    run_dir, job, attempts = interrupt_twice(tmp_path, "lightning", lightning_job(nodes=2, devices=2), ranks_per_node=2)
    logs = task_logs(run_dir)
    assert f"lightning job: {STEPS} steps over 4 ranks done" in logs  # the script ran to its end, over both nodes
    assert logs.count("saved ") >= 2 and "hpc_ckpt_1.ckpt" in logs and "hpc_ckpt_2.ckpt" in logs
    assert sorted(p.name for p in (run_dir / "lightning").glob("hpc_ckpt_*")) == [
        "hpc_ckpt_1.ckpt",
        "hpc_ckpt_2.ckpt",
    ]  # the newest two kept
    assert "Restoring states from the checkpoint path" in logs + "".join(
        p.read_text(errors="replace") for p in (run_dir / "logs").glob("*_log.err")
    )
    print(f"attempts {[(a[0], a[-1]) for a in attempts]}, duration {time.monotonic() - began:.0f} s")


def test_torchrun_script_on_two_nodes_requeued_by_usr2_and_preemption(tmp_path: Path) -> None:
    began = time.monotonic()
    run_dir, job, attempts = interrupt_twice(tmp_path, "torchrun", TORCHRUN_JOB, ranks_per_node=2)
    assert (run_dir / "command-ok").read_text().strip() == "4"  # its final all-reduce summed over 4 ranks
    starts = [int(x) for x in (run_dir / "command-starts").read_text().split()]
    assert starts == [0, attempts[1][0] - 1, attempts[2][0] - 1], (starts, attempts)
    script = (run_dir / "script.sh").read_text()
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --cpus-per-task=2" in script  # one torchrun per node
    print(f"attempts {[(a[0], a[-1]) for a in attempts]}, duration {time.monotonic() - began:.0f} s")


def test_lightning_array_requeues_only_the_signalled_task(tmp_path: Path) -> None:
    """Two sweep points as one job array (1 node x 1 rank each): USR2 to task 0 requeues task 0
    alone (Lightning's own requeue once requeued whole arrays); both complete."""
    began = time.monotonic()
    site = site_copy(tmp_path, "testcluster")
    rec = tmp_path / "points.yaml"
    rec.write_text(
        json.dumps(
            {
                "name": "points",
                "job": lightning_job(nodes=1, devices=1),
                "resources": {"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"},
                "sweep": {"axes": {"training.seed": [1, 2]}},
            }
        )
    )
    out = hpcrun("sweep", "--site", str(site), str(rec)).stdout
    assert "submitted 2 point(s)" in out, out
    sweep_dir = next((tmp_path / "runs" / "sweeps").iterdir())
    ledger = json.loads((sweep_dir / "ledger.json").read_text())["points"]
    by_task = {e["job_id"]: tmp_path / "runs" / e["run_id"] for e in ledger.values()}
    assert len(by_task) == 2 and len({j.split("_")[0] for j in by_task}) == 1, by_task  # one array
    first, second = sorted(by_task)
    wait_reported(by_task[first], first, 0, 5)
    subprocess.run(["scancel", "--signal=USR2", first], check=True)
    for task, run_dir in by_task.items():
        assert wait_done(run_dir, timeout=600)["status"] == "completed", task
    assert records(first) == ["REQUEUED", "COMPLETED"], records(first)
    assert records(second) == ["COMPLETED"], records(second)
    first_attempts = reported(by_task[first], first)
    assert len(first_attempts) == 2 and first_attempts[1][0] == first_attempts[0][-1] + 1, first_attempts
    assert state(by_task[second])["attempt"] == 0
    print(f"duration {time.monotonic() - began:.0f} s")
