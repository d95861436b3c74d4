"""What recovery costs while nothing fails, as the wall clock sees it: the same training with
hpcrun's checkpoint and snapshot defaults and with both off, alternating (ABAB), on the test
cluster at 2 nodes x 2 ranks (so replicas cross the network) or on `--site local`.

Throughput is wall-clock: tokens over the time from the end of step `--warmup` to the end of the
last step, read from the steps table, so every save's and snapshot's stall and the slower steps
beside their background work are in it (the final save, the same in both arms, is not). The
`heavy` model is `small` with 512 MiB more state per replica (hpcrun.sizes): a snapshot's copy
takes several steps, as a 15 GB state's does at a GPU's 0.13 s step.

The defaults arm is the recipe with no `checkpoint` settings, or only a shorter longest interval
(`--max-minutes`, `--memory-max-minutes`; the defaults are 30 and 5) so that a run of minutes holds
a save of each kind: more saves than the defaults make, never fewer. Saves cost at most 1% of the
time each by design once measured, so before the first (planned from an estimate, 5 s per GB of
state on CPU ranks) a run holds none: runs shorter than ~5 minutes measure nothing.

    bash tests/cluster/testcluster.sh up
    python benchmarks/recovery_cost.py [--model heavy] [--steps 1200] [--rounds 4] [--site testcluster|local]
        [--max-minutes 5] [--memory-max-minutes 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py

# rank 0's last line ends with how each kind was spaced: "...; checkpoints every ...; snapshots every ..."
SAVES = re.compile(r"(?:checkpoints|snapshots) every .*?(?=; (?:checkpoints|snapshots) every |$)", re.M)


def run(site: Path, tmp: Path, args: argparse.Namespace, arm: str) -> tuple[float, str]:
    """One run; its wall-clock tokens/s and what rank 0 said of its saves."""
    caps = {"max_minutes": args.max_minutes, "memory_max_minutes": args.memory_max_minutes}
    off = {"interval": 10**9, "memory_interval": 0}
    checkpoint = {k: v for k, v in caps.items() if v is not None} if arm == "defaults" else off
    nodes, ranks = (2, 2) if args.site == "testcluster" else (1, 2)
    recipe = tmp / f"{arm}.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": f"recovery-{arm}", "job": {"kind": "benchmark", "model": args.model},
        "resources": {"nodes": nodes, "gpus_per_node": ranks, "time": "00:30:00"},
        "training": {"steps": args.steps, "micro_batch": 4, "seq_len": 64}, "checkpoint": checkpoint,
    }))
    out = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(site), "--wait", str(recipe)],
        capture_output=True, text=True, cwd=ROOT,
    )
    if out.returncode != 0 or "completed" not in out.stdout:
        raise SystemExit(f"{arm} run failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    run_dir = Path(re.findall(r"run dir: (\S+)", out.stdout)[-1])
    from hpcrun.steps import load_steps

    steps = load_steps(str(tmp / "results"), run_id=run_dir.name).sort_values("step")
    assert len(steps) == args.steps and steps["attempt"].nunique() == 1, "one uninterrupted attempt"
    timed = steps[steps["step"] >= args.warmup]
    seconds = (timed["time"].iloc[-1] - timed["time"].iloc[0]).total_seconds()
    tokens = (len(timed) - 1) * 4 * 64 * nodes * ranks
    logs = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*_0_log.out")))
    saves = "; ".join(m.group(0) for m in SAVES.finditer(logs))
    if arm == "defaults" and " measured at " not in saves:  # a ratio of 1.0 that measured nothing
        raise SystemExit(f"the defaults arm ({tokens / seconds:.0f} tok/s) made no periodic save in {args.steps} "
                         f"steps: raise --steps ({saves})")
    return tokens / seconds, saves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", choices=["testcluster", "local"], default="testcluster")
    parser.add_argument("--model", default="heavy")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-minutes", type=float, default=None, help="checkpoint.max_minutes (default: 30)")
    parser.add_argument("--memory-max-minutes", type=float, default=None, help="checkpoint.memory_max_minutes (5)")
    args = parser.parse_args()
    tmp = scratch("recovery-cost-", "/var/tmp" if args.site == "testcluster" else None)
    site = scratch_site(tmp, args.site)
    ratios = []
    for round_ in range(args.rounds):
        order = ("off", "defaults") if round_ % 2 == 0 else ("defaults", "off")  # ABAB/BABA
        measured = {arm: run(site, tmp, args, arm) for arm in order}
        ratios.append(measured["defaults"][0] / measured["off"][0])
        print(f"round {round_ + 1}: off {measured['off'][0]:.0f} tok/s (wall clock), defaults "
              f"{measured['defaults'][0]:.0f} tok/s, ratio {ratios[-1]:.3f}; {measured['defaults'][1]}", flush=True)
    print(f"{args.model} on {args.site}, {args.steps} steps: wall-clock throughput with the defaults / with both off, "
          f"median {statistics.median(ratios):.3f} (spread {min(ratios):.3f}-{max(ratios):.3f}, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
