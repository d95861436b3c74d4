"""Training overhead: the built-in benchmark under hpcrun (submitit local executor, DDP, 2
processes, gloo on CPU) against a minimal hand-written torch DDP loop on the same model and
data, alternated in the same run. Target: hpcrun's throughput >= 0.98 of the bare loop.

    python benchmarks/training_overhead.py [--model small] [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
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


def run_hpcrun(args: argparse.Namespace, tmp: Path, n: int) -> float:
    from hpcrun.results import load

    scratch_site(tmp, "local")
    recipe = {
        "name": f"overhead{n}", "job": {"kind": "benchmark", "model": args.model}, "resources": {"nodes": 1, "gpus_per_node": 2, "time": "00:30:00"},
        "training": {"steps": args.steps, "warmup_steps": args.warmup, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "lr": 1e-3},
        "checkpoint": {"interval": 10**6},  # the bare loop saves nothing either (apart from the final save)
    }
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    subprocess.run([sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(tmp / "site.yaml"), "--wait", str(tmp / "recipe.yaml")], cwd=ROOT, check=True, capture_output=True)
    df = load(tmp / "results")
    return float(df[df["run_id"].str.endswith(f"overhead{n}")]["tokens_per_s"].iloc[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = scratch("overhead-")
    bare_tps, hpc_tps = [], []
    for n in range(args.rounds):  # ABBA order, so drift on a noisy machine hits both alike
        if n % 2 == 0:
            bare_tps.append(run_bare(args, tmp))
            hpc_tps.append(run_hpcrun(args, tmp, n))
        else:
            hpc_tps.append(run_hpcrun(args, tmp, n))
            bare_tps.append(run_bare(args, tmp))
        print(f"round {n}: bare {bare_tps[-1]:.0f} tokens/s, hpcrun {hpc_tps[-1]:.0f} tokens/s, ratio {hpc_tps[-1] / bare_tps[-1]:.3f}", flush=True)
    ratios = [h / b for h, b in zip(hpc_tps, bare_tps)]
    print(f"ratio hpcrun / bare loop: median {statistics.median(ratios):.3f}, mean {statistics.fmean(ratios):.3f}, "
          f"of totals {sum(hpc_tps) / sum(bare_tps):.3f}, spread {min(ratios):.3f}-{max(ratios):.3f} (target >= 0.98)")


if __name__ == "__main__":
    main()
