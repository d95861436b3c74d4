"""Checkpoint cost: the blocking stall per save as a share of step time, and save bandwidth
against this disk's own sequential write speed measured in the same run (one process, DDP,
the built-in model). Targets: stall <= one step time and < 1% of wall time at the default
interval; bandwidth >= 0.7 of the disk's.

    python benchmarks/checkpoint_cost.py [--model 125m] [--saves 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def disk_write_speed(directory: Path, nbytes: int) -> float:
    """Bytes/s of one sequential write of `nbytes` with fsync, like a checkpoint file."""
    block = os.urandom(1 << 20)
    path = directory / "ddtest"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes >> 20)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return max(1, nbytes >> 20) * (1 << 20) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="125m")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    from hpcrun.recipe import Recipe
    from hpcrun.runtime import checkpoint as ckpt
    from hpcrun.runtime import strategies
    from hpcrun.runtime.env import DistEnv
    from hpcrun.runtime.model import GPT, synthetic_batch
    from hpcrun.sizes import SIZES

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-cost-"))
    env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "bench", "localhost")
    recipe = Recipe.model_validate({"name": "c", "job": {"kind": "benchmark", "model": args.model}, "training": {"micro_batch": 2, "seq_len": 128}})
    size = SIZES[args.model]
    engine = strategies.setup(GPT(size, 128), lambda p: torch.optim.AdamW(p, lr=1e-4), recipe, env)
    step_times = []
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = synthetic_batch(0, step, 0, 2, 128, size.vocab)
        engine.micro_step(x, y, last=True)
        engine.optimizer_step()
        step_times.append(time.perf_counter() - start)
    step = statistics.median(step_times[1:])
    cps = ckpt.Checkpoints(tmp / "checkpoints", env, keep=2, strategy="ddp")
    stalls, sizes = [], []
    for n in range(args.saves):
        stalls.append(cps.save(engine, n + 1, {"step": n + 1}))
        sizes.append(sum(f.stat().st_size for f in ckpt.step_dir(cps.root, n + 1).rglob("*") if f.is_file()))
    stall = statistics.median(stalls)
    nbytes = int(statistics.median(sizes))
    disk = statistics.median(disk_write_speed(tmp, nbytes) for _ in range(3))
    bandwidth = nbytes / stall
    interval = Recipe.model_fields["checkpoint"].default.interval
    print(f"model {args.model}: checkpoint {nbytes / 2**20:.0f} MiB, step {step * 1000:.0f} ms, save stall {stall * 1000:.0f} ms")
    print(f"stall / step time: {stall / step:.2f} (target <= 1)")
    print(f"stall share of wall time at interval {interval}: {stall / (stall + interval * step) * 100:.2f}% (target < 1%)")
    print(f"save bandwidth {bandwidth / 2**20:.0f} MiB/s vs disk sequential write {disk / 2**20:.0f} MiB/s: {bandwidth / disk:.2f} (target >= 0.7)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
