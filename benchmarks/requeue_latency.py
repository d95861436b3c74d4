"""Requeue latency on the test cluster: from `scancel --signal=USR2` to the resumed attempt's
start, and the steps lost (target 0). Needs tests/cluster/testcluster.sh up.

    python benchmarks/requeue_latency.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml
from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    from hpcrun.results import load

    tmp = scratch("requeue-latency-", "/var/tmp")
    scratch_site(tmp, "testcluster", name="latency")
    hold = next((ln.split("cred_expire=")[1].split(",")[0] for ln in subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout.splitlines() if "cred_expire=" in ln), "120")
    print(f"SLURM requeue hold (AuthInfo cred_expire): {hold} s")
    for n in range(args.repeat):
        recipe = {"name": f"latency{n}", "job": {"kind": "benchmark", "model": "tiny"}, "resources": {"nodes": 1, "gpus_per_node": 2, "time": "00:10:00"},
                  "training": {"steps": 600, "micro_batch": 2, "seq_len": 32}, "checkpoint": {"interval": 50}}
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        out = subprocess.run([sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(tmp / "site.yaml"), str(tmp / "recipe.yaml")], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        run_dir = Path(next(ln.split("run dir:")[1].strip() for ln in out.splitlines() if "run dir:" in ln))
        job = json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]
        while not any((run_dir / "checkpoints").glob("step-*")):
            time.sleep(0.1)
        signalled = dt.datetime.now(dt.timezone.utc)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        while not ((run_dir / "state.json").exists() and json.loads((run_dir / "state.json").read_text())["status"] == "completed"):
            time.sleep(1)
        df = load(tmp / "results", run_id=run_dir.name).sort_values("restart_count")
        first, second = df.iloc[0], df.iloc[1]
        latency = (second["start_time"] - signalled).total_seconds()
        stop_latency = (first["end_time"] - signalled).total_seconds()
        lost = int(first["last_step"]) - int(second["first_step"])
        print(f"run {n}: signal -> checkpointed and exited {stop_latency:.1f} s; signal -> resumed attempt ready {latency:.1f} s "
              f"(of which SLURM's hold {hold} s); stopped at step {first['last_step']}, resumed at {second['first_step']}: {lost} steps lost")


if __name__ == "__main__":
    main()
