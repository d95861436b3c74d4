"""Training overhead: the built-in benchmark under hpcrun (submitit local executor, DDP, 2
processes, gloo on CPU) against a minimal hand-written torch DDP loop on the same model and
data, alternated in the same run. Target: hpcrun's throughput >= 0.98 of the bare loop.

Per-step metrics (the steps table, the per-rank step-time gather, progress.json) are measured
apart, because their cost is far below the rounds' noise: each hpcrun run's rank 0 reports the
time its training thread spent recording and flushing them (`hpcrun.runtime.steps`), and this
script prints it as a share of the run's step time (target <= 0.5%). `--flush-steps` sets
`metrics.flush_steps` (default: the recipe default, 100; 1 is the worst case).

    python benchmarks/training_overhead.py [--model small] [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py


def bare(rank: int, world: int, model: str, steps: int, warmup: int, mb: int, seq: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpcrun.runtime.model import GPT, synthetic_batch
    from hpcrun.sizes import SIZES

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # what the local site profile gives hpcrun's ranks
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))  # hpcrun's share of cores per rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    size = SIZES[model]
    ddp = DistributedDataParallel(GPT(size, seq), gradient_as_bucket_view=True)  # as hpcrun's default, so only the harness differs
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        x, y = synthetic_batch(0, step, rank * mb, mb, seq, size.vocab)
        loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(str(world * mb * seq / statistics.fmean(times[warmup:])))
    dist.destroy_process_group()


def run_bare(args: argparse.Namespace, tmp: Path) -> float:
    import torch.multiprocessing as mp

    out = tmp / "bare.txt"
    mp.spawn(bare, args=(2, args.model, args.steps, args.warmup, args.micro_batch, args.seq_len, 29000 + os.getpid() % 1000, str(out)), nprocs=2)
    return float(out.read_text())


def metrics_share(tmp: Path, run_id: str) -> float:
    """The share of step time rank 0's training thread spent on per-step metrics, from its log."""
    from hpcrun.rundir import RunDir

    run = RunDir(tmp / "runs" / run_id)
    log = run.log(run.latest_job()["job_id"], 0, "out").read_text()  # type: ignore[index]
    found = re.search(r"per-step metrics: [\d.]+ ms on the training thread over \d+ steps \(([\d.]+)% of step time\)", log)
    assert found, f"no per-step metrics line in {run.path}'s rank 0 log"
    return float(found.group(1)) / 100


def run_hpcrun(args: argparse.Namespace, tmp: Path, n: int, shares: list[float]) -> float:
    from hpcrun.results import load

    scratch_site(tmp, "local")
    recipe = {
        "name": f"overhead{n}", "job": {"kind": "benchmark", "model": args.model}, "resources": {"nodes": 1, "gpus_per_node": 2, "time": "00:30:00"},
        "training": {"steps": args.steps, "warmup_steps": args.warmup, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "lr": 1e-3},
        "checkpoint": {"interval": 10**6},  # the bare loop saves nothing either (apart from the final save)
    }
    if args.flush_steps:
        recipe["metrics"] = {"flush_steps": args.flush_steps}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    subprocess.run([sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(tmp / "site.yaml"), "--wait", str(tmp / "recipe.yaml")], cwd=ROOT, check=True, capture_output=True)
    df = load(tmp / "results")
    row = df[df["run_id"].str.endswith(f"overhead{n}")].iloc[0]
    shares.append(metrics_share(tmp, row["run_id"]))
    return float(row["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flush-steps", type=int, default=None)
    args = parser.parse_args()
    tmp = scratch("overhead-")
    bare_tps: list[float] = []
    hpc_tps: list[float] = []
    shares: list[float] = []
    for n in range(args.rounds):  # ABBA order, so drift on a noisy machine hits both alike
        if n % 2 == 0:
            bare_tps.append(run_bare(args, tmp))
            hpc_tps.append(run_hpcrun(args, tmp, n, shares))
        else:
            hpc_tps.append(run_hpcrun(args, tmp, n, shares))
            bare_tps.append(run_bare(args, tmp))
        print(f"round {n}: bare {bare_tps[-1]:.0f} tokens/s, hpcrun {hpc_tps[-1]:.0f} tokens/s, ratio {hpc_tps[-1] / bare_tps[-1]:.3f}, "
              f"per-step metrics {100 * shares[-1]:.3f}% of step time", flush=True)
    ratios = [h / b for h, b in zip(hpc_tps, bare_tps)]
    print(f"ratio hpcrun / bare loop: median {statistics.median(ratios):.3f}, mean {statistics.fmean(ratios):.3f}, "
          f"of totals {sum(hpc_tps) / sum(bare_tps):.3f}, spread {min(ratios):.3f}-{max(ratios):.3f} (target >= 0.98)")
    print(f"per-step metrics, share of step time: median {100 * statistics.median(shares):.3f}%, max {100 * max(shares):.3f}% (target <= 0.5%)")


if __name__ == "__main__":
    main()
