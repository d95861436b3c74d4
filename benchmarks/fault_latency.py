"""Fault latency on the test cluster: for each kind of interruption, the time from the fault to
the attempt's end (no rank process of the job left) and to the first step the resumed attempt
completes, with SLURM's part shown apart (the requeue hold, `AuthInfo=cred_expire`; for a lost
node also `SlurmdTimeout`, after which SLURM declares it down). Baseline in the same run: the
polite interruption, USR2 (what hpcrun already handled). Needs tests/cluster/testcluster.sh up.

    python benchmarks/fault_latency.py [--faults usr2,kill,hang,node] [--repeat 1]

  usr2  `scancel --signal=USR2`: checkpoint at the next step and requeue
  kill  SIGKILL to the last rank of a 2-node x 2-rank job
  hang  SIGSTOP to the last rank, with `fault.hang_timeout_s: 20`
  node  every process of the node under a 1-node job, its slurmd included, SIGKILLed
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


def one(tmp: Path, fault: str, n: int) -> str:
    from hpcrun.results import load_steps

    nodes = 2 if fault in ("kill", "hang") else 1
    world = 2 * nodes
    recipe = {
        "name": f"{fault}{n}", "job": entrypoint_job(str(ROOT), 0.1),
        "resources": {"nodes": nodes, "gpus_per_node": 2, "time": "00:15:00"},
        "training": {"steps": 400, "micro_batch": 2, "seq_len": 32}, "checkpoint": {"interval": 20, "max_requeues": 3},
    }
    if fault == "hang":
        recipe["fault"] = {"hang_timeout_s": HANG_TIMEOUT_S}
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
    faults.rank_pid(job, world - 1)
    node = ""
    try:
        fault_at = time.time()
        if fault == "usr2":
            subprocess.run(["scancel", "--signal=USR2", job], check=True)
        elif fault == "kill":
            faults.signal_rank(job, world - 1, signal.SIGKILL)
        elif fault == "hang":
            faults.signal_rank(job, world - 1, signal.SIGSTOP)
        else:
            _, node = faults.rank_pid(job, 0)
            faults.power_off(node)
        while faults.ranks_alive(job, world):
            time.sleep(0.2)
        ended = time.time() - fault_at
        deadline = time.time() + 600
        while time.time() < deadline:
            if state(run_dir).get("status") == "completed":
                break
            time.sleep(1)
        else:
            return f"{fault} {n}: did not complete: {state(run_dir)}"
        steps = load_steps(tmp / "results", run_id=run_dir.name)
        resumed = steps[steps.restart_count >= 1]["time"].min()
        first_step = (resumed - dt.datetime.fromtimestamp(fault_at, dt.timezone.utc)).total_seconds()
    finally:
        if node:
            faults.power_on(node)
    return f"| {fault} | {n} | {ended:.1f} s | {first_step:.1f} s |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--faults", default="usr2,kill,hang,node")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    tmp = scratch("fault-latency-", "/var/tmp")
    scratch_site(tmp, "testcluster", name="latency")
    print(
        f"SLURM: requeue hold (AuthInfo cred_expire) {config('cred_expire=', '120')} s, "
        f"SlurmdTimeout {config('SlurmdTimeout', '300')}, "
        f"KillWait {config('KillWait', '30')}; hang timeout {HANG_TIMEOUT_S} s"
    )
    print("| fault | run | fault -> no rank left | fault -> first resumed step completed |")
    print("|---|---|---|---|")
    for fault in args.faults.split(","):
        for n in range(args.repeat):
            print(one(tmp, fault, n), flush=True)


if __name__ == "__main__":
    main()
