"""In-memory snapshot cost (checkpoint.memory_interval) on the built-in benchmark's default recipe
(the tiny GPT, 2 ranks, `--site local`, disk checkpoints every 50 steps as by default): the same
run with snapshots off and on, alternating (ABAB), and per round the throughput ratio, plus what
rank 0 reports in-process: the stall each snapshot puts on its training thread and its share of
step time. The ratio also carries the snapshot thread's CPU, which on a 2-core machine competes
with the ranks; on a GPU node it runs on cores training leaves idle.

    python benchmarks/snapshot_cost.py [--interval N] [--rounds 4] [--steps 600]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STALL = re.compile(r"in-memory snapshots: (\d+), ([\d.]+) ms each on the training thread \(([\d.]+)% of step time\)")


def run(tmp: Path, site: Path, steps: int, interval: int) -> tuple[float, str]:
    recipe = tmp / f"snapshots-{interval}.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": f"snapshots-{interval}", "job": {"kind": "benchmark"},
        "resources": {"nodes": 1, "gpus_per_node": 2, "time": "00:30:00"},
        "training": {"steps": steps}, "checkpoint": {"memory_interval": interval},
    }))
    out = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(site), "--wait", str(recipe)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )
    tokens = float(re.findall(r"([\d.]+) tokens/s", out.stdout)[-1])
    run_dir = Path(re.findall(r"run dir: (\S+)", out.stdout)[-1])
    logs = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*_0_log.out")))
    found = STALL.search(logs)
    return tokens, found.group(0) if found else "no snapshots"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interval", type=int, default=None, help="memory_interval (default: the recipe default)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    from hpcrun.recipe import MEMORY_INTERVAL

    interval = args.interval or MEMORY_INTERVAL
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        site_data = yaml.safe_load((ROOT / "sites" / "local.yaml").read_text())
        site_data["storage"].update(runs_dir=str(tmp / "runs"), results_dir=str(tmp / "results"))
        site = tmp / "local.yaml"
        site.write_text(yaml.safe_dump(site_data))
        ratios, stalls = [], []
        for round_ in range(args.rounds):
            order = (0, interval) if round_ % 2 == 0 else (interval, 0)  # ABAB/BABA
            measured = {i: run(tmp, site, args.steps, i) for i in order}
            ratios.append(measured[interval][0] / measured[0][0])
            stalls.append(measured[interval][1])
            print(f"round {round_ + 1}: off {measured[0][0]:.0f} tok/s, every {interval} steps "
                  f"{measured[interval][0]:.0f} tok/s, ratio {ratios[-1]:.3f}; {stalls[-1]}", flush=True)
        found = [m for m in (STALL.search(s) for s in stalls) if m]
        each, shares = [float(m.group(2)) for m in found], [float(m.group(3)) for m in found]
        print(
            f"memory_interval {interval}: throughput with / without snapshots, median "
            f"{statistics.median(ratios):.3f} (spread {min(ratios):.3f}-{max(ratios):.3f}); stall per snapshot "
            f"median {statistics.median(each):.1f} ms, {statistics.median(shares):.3f}% of step time"
        )


if __name__ == "__main__":
    main()
