"""Fault latency on the test cluster: for each kind of interruption, the time from the fault to
the attempt's end (no rank process of the job's first attempt left) and to the first step the
resumed attempt completes, with SLURM's part shown apart (the requeue hold, `AuthInfo=cred_expire`;
for a lost node also `SlurmdTimeout`, after which SLURM declares it down). Baseline in the same
run: the polite interruption, USR2 (what hpcrun already handled). Needs tests/cluster/testcluster.sh up.

    python benchmarks/fault_latency.py [--faults usr2,kill,hang,node] [--repeat 1] [--restarts-in-job 0]

  usr2  `scancel --signal=USR2`: checkpoint at the next step and requeue
  kill  SIGKILL to the last rank of a 2-node x 2-rank job
  hang  SIGSTOP to the last rank, with `fault.hang_timeout_s: 20`
  node  every process of the node under a 1-node job, its slurmd included, SIGKILLed

Which path a fault takes is `fault.restarts_in_job`: by default 0 here, so every fault goes through
a SLURM requeue (RESULTS.md §3); `--restarts-in-job 5` (hpcrun's default) times the path inside
the job for `kill` and `hang` (§3b) while `usr2` still requeues (a stop for a signal always does).
Each row names the path the run took, from SLURM's accounting (a requeue leaves a record per
attempt). Disk checkpoints every 20 steps, set explicitly (by default they are spaced by time,
minutes apart): the fault comes after the first one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import yaml
from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py

sys.path.insert(0, str(ROOT))
from tests import faults  # noqa: E402  (the fault helpers the tests use)
from tests.delayed_training import entrypoint_job  # noqa: E402

HANG_TIMEOUT_S = 20


def config(key: str, default: str) -> str:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if key in line:
            value = line.split(key)[1].lstrip(" =").split(",")[0].split()[0]
            return value
    return default


def state(run_dir: Path) -> dict[str, tp.Any]:
    path = run_dir / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def path_taken(job: str) -> str:
    """`requeue` when SLURM's accounting shows the job went back through the queue (a REQUEUED,
    PREEMPTED or NODE_FAIL record before its last), else `in job` (a dropped node adds RESIZING)."""
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
    earlier = [line.split()[0] for line in out.stdout.split("\n") if line.strip()][:-1]
    return "requeue" if {"REQUEUED", "PREEMPTED", "NODE_FAIL"} & set(earlier) else "in job"


def one(tmp: Path, fault: str, n: int, restarts_in_job: int) -> str:
    from hpcrun.results import load_steps

    nodes = 2 if fault in ("kill", "hang") else 1
    world = 2 * nodes
    fault_fields: dict[str, int] = {"restarts_in_job": restarts_in_job}
    if fault == "hang":
        fault_fields["hang_timeout_s"] = HANG_TIMEOUT_S
    recipe = {
        "name": f"{fault}{n}", "job": entrypoint_job(str(ROOT), 0.1), "fault": fault_fields,
        "resources": {"nodes": nodes, "gpus_per_node": 2, "time": "00:15:00"},
        "training": {"steps": 400, "micro_batch": 2, "seq_len": 32}, "checkpoint": {"interval": 20, "max_requeues": 3},
    }
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    out = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(tmp / "site.yaml"), str(tmp / "recipe.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    run_dir = Path(next(ln.split("run dir:")[1].strip() for ln in out.splitlines() if "run dir:" in ln))
    job = json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]
    while not any((run_dir / "checkpoints").glob("step-*")):
        time.sleep(0.1)
    faults.rank_pid(job, world - 1, attempt=0)
    node = ""
    try:
        fault_at = time.time()
        if fault == "usr2":
            subprocess.run(["scancel", "--signal=USR2", job], check=True)
        elif fault == "kill":
            faults.signal_rank(job, world - 1, signal.SIGKILL, attempt=0)
        elif fault == "hang":
            faults.signal_rank(job, world - 1, signal.SIGSTOP, attempt=0)
        else:
            _, node = faults.rank_pid(job, 0, attempt=0)
            faults.power_off(node)
        while faults.ranks_alive(job, world, attempt=0):  # a restart in the job starts attempt 1
            time.sleep(0.2)
        ended = time.time() - fault_at
        deadline = time.time() + 600
        while time.time() < deadline:
            if state(run_dir).get("status") == "completed":
                break
            time.sleep(1)
        else:
            return f"{fault} {n}: did not complete ({path_taken(job)}): {state(run_dir)}"
        steps = load_steps(tmp / "results", run_id=run_dir.name)
        resumed = steps[steps.attempt >= 1]["time"].min()
        first_step = (resumed - dt.datetime.fromtimestamp(fault_at, dt.timezone.utc)).total_seconds()
    finally:
        if node:
            faults.power_on(node)
    return f"| {fault} | {path_taken(job)} | {n} | {ended:.1f} s | {first_step:.1f} s |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--faults", default="usr2,kill,hang,node")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--restarts-in-job", type=int, default=0,
        help="fault.restarts_in_job: 0 (default) times the requeue path; 5, hpcrun's default, the path in the job",
    )
    args = parser.parse_args()
    tmp = scratch("fault-latency-", "/var/tmp")
    scratch_site(tmp, "testcluster", name="latency")
    print(
        f"SLURM: requeue hold (AuthInfo cred_expire) {config('cred_expire=', '120')} s, "
        f"SlurmdTimeout {config('SlurmdTimeout', '300')}, "
        f"KillWait {config('KillWait', '30')}; hang timeout {HANG_TIMEOUT_S} s; "
        f"fault.restarts_in_job {args.restarts_in_job}"
    )
    print("| fault | path | run | fault -> no rank left | fault -> first resumed step completed |")
    print("|---|---|---|---|---|")
    for fault in args.faults.split(","):
        for n in range(args.repeat):
            print(one(tmp, fault, n, args.restarts_in_job), flush=True)


if __name__ == "__main__":
    main()
