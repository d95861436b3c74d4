"""Campaign scale on the real controller (the test cluster, `testcluster.sh up --nodes 8`): for
sweeps of 100, 1,000 and 5,000 points, the time `hpcrun sweep` takes to submit them, its sbatch
calls, the time of a cold `hpcrun status` of the whole sweep and of a warm one (the answer shared
by hpcrun.pollcache), the RPCs each costs slurmctld and slurmdbd (SLURM's own per-user counters),
and the time and RPCs of `hpcrun cancel` of the sweep. Everything runs as the unprivileged
`hpcwatch` user, so the counters hold its calls only (root's include the daemons' own).

The points are `sleep 600` command jobs with `max_concurrent: 1` (one task per array runs), all
cancelled at the end. Printed: a row per size, then the slope per 1,000 points.

    python benchmarks/campaign_scale.py [--sizes 100,1000,5000] [--partition scale]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import typing as tp
import uuid
from pathlib import Path

import yaml
from scratch import ROOT

sys.path.insert(0, str(ROOT))
from tests.slurmstats import WATCHER as USER  # noqa: E402  (what the polling test counts with)
from tests.slurmstats import hpcrun_as, rpc_counts  # noqa: E402


def as_user(base: Path, *args: str) -> tuple[float, str, tuple[int, int]]:
    """`hpcrun ARGS` as USER: (seconds, stdout, (slurmctld, slurmdbd) RPCs it made)."""
    env = {**os.environ, "HOME": str(base), "HPCRUN_CACHE_DIR": str(base / "cache"), "PYTHONPATH": str(ROOT)}
    before = rpc_counts(USER)
    start = time.perf_counter()
    out = subprocess.run([*hpcrun_as(USER), *args], env=env, cwd=base, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = rpc_counts(USER)
    if out.returncode != 0:
        raise SystemExit(f"hpcrun {' '.join(args)} exited {out.returncode}: {out.stderr[-2000:]}")
    return seconds, out.stdout, (after[0] - before[0], after[1] - before[1])


def site(base: Path, partition: str, nodes: int) -> Path:
    data = yaml.safe_load((ROOT / "sites" / "testcluster.yaml").read_text())
    data.update(name="campaign-scale", default_partition=partition)
    data["partitions"] = {
        partition: {
            "max_nodes": nodes,
            "gpus_per_node": 0,
            "cpus_per_node": 2,
            "memory_gb": 3.9,
            "max_time": "01:00:00",
        }
    }
    data["storage"] = {"runs_dir": str(base / "runs"), "results_dir": str(base / "results")}
    path = base / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def measure(size: int, partition: str, nodes: int) -> dict[str, tp.Any]:
    base = Path("/var/tmp") / f"hpcrun-campaign-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o755)
    try:
        shutil.chown(base, USER)
        where = site(base, partition, nodes)
        recipe = base / "campaign.yaml"
        recipe.write_text(yaml.safe_dump({
            "name": f"campaign{size}", "job": {"kind": "command", "command": ["sleep", "600"]},
            "resources": {"nodes": 1, "gpus_per_node": 1, "time": "00:20:00"},
            "sweep": {"axes": {"training.seed": list(range(size))}, "max_concurrent": 1},
        }))
        for path in (where, recipe):
            shutil.chown(path, USER)
        submit_s, out, submit_rpc = as_user(base, "sweep", "--site", str(where), str(recipe))
        arrays = len(re.findall(r"^  array ", out, re.MULTILINE))
        assert f"submitted {size} point(s)" in out, out[-1000:]
        sweep = next((base / "runs" / "sweeps").iterdir()).name
        cold_s, shown, cold_rpc = as_user(base, "status", "--site", str(where), sweep)
        warm_s, _, warm_rpc = as_user(base, "status", "--site", str(where), sweep)
        assert (
            re.match(r"done \d+  running \d+  pending \d+  failed 0", shown.splitlines()[0])
            and shown.count("\n") == size + 1
        ), shown[:300]
        cancel_s, _, cancel_rpc = as_user(base, "cancel", "--site", str(where), sweep)
        return {
            "points": size,
            "arrays": arrays,
            "sweep_s": submit_s,
            "sweep_rpc": submit_rpc,
            "cold_s": cold_s,
            "cold_rpc": cold_rpc,
            "warm_s": warm_s,
            "warm_rpc": warm_rpc,
            "cancel_s": cancel_s,
            "cancel_rpc": cancel_rpc,
        }
    finally:
        subprocess.run(["scancel", "-u", USER], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100,1000,5000")
    parser.add_argument("--partition", default="scale")
    args = parser.parse_args()
    nodes = len(
        set(
            subprocess.run(
                ["sinfo", "-h", "-p", args.partition, "-N", "-o", "%N"], capture_output=True, text=True
            ).stdout.split()
        )
    )
    if not nodes:
        raise SystemExit(f"no partition {args.partition!r}: bring the test cluster up with --nodes 8")
    rows = [measure(int(n), args.partition, nodes) for n in args.sizes.split(",")]
    print(
        "| points | sbatch calls (arrays) | `hpcrun sweep` | RPCs ctld/dbd | cold `status` | RPCs ctld/dbd "
        "| warm `status` | RPCs | `cancel` | RPCs ctld/dbd |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['points']:,} | {r['arrays']} | {r['sweep_s']:.1f} s | {r['sweep_rpc'][0]}/{r['sweep_rpc'][1]} "
            f"| {r['cold_s']:.2f} s | {r['cold_rpc'][0]}/{r['cold_rpc'][1]} "
            f"| {r['warm_s']:.2f} s | {r['warm_rpc'][0]}/{r['warm_rpc'][1]} "
            f"| {r['cancel_s']:.2f} s | {r['cancel_rpc'][0]}/{r['cancel_rpc'][1]} |"
        )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        per = 1000 / (last["points"] - first["points"])
        print(
            f"slope per 1,000 points: sweep {per * (last['sweep_s'] - first['sweep_s']):.2f} s, "
            f"cold status {per * (last['cold_s'] - first['cold_s']):.2f} s, "
            f"warm status {per * (last['warm_s'] - first['warm_s']):.2f} s, "
            f"cancel {per * (last['cancel_s'] - first['cancel_s']):.2f} s; "
            f"RPCs per status poll: {last['cold_rpc'][1]} (slurmdbd) at {last['points']:,} points "
            f"vs {first['cold_rpc'][1]} at {first['points']:,}"
        )


if __name__ == "__main__":
    main()
