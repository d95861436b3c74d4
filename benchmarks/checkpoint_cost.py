"""Checkpoint cost: what a save costs training, and how fast it writes against this disk's own
sequential write speed measured in the same run (one process, DDP, the built-in model, the
real `Checkpoints` class). Targets: stall <= one step time and < 1% of wall time at the
default interval; bandwidth >= 0.7 of the disk's.

Three ways of saving are measured side by side:
- synchronous: training waits for the whole write (what DeepSpeed engines do);
- asynchronous, stall: the time `save()` blocks (the copy of the state to host memory);
- asynchronous, cost: the stall plus how much slower the steps run while the background write
  shares the CPU with them, against steps with no save in flight. On a 2-core machine the
  writer competes with training for cores; on a GPU node it does not.

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
    parser.add_argument("--steps", type=int, default=6, help="clean steps timed before the saves")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    from hpcrun.recipe import Recipe
    from hpcrun.runtime import checkpoint as ckpt
    from hpcrun.runtime import strategies
    from hpcrun.runtime.env import DistEnv, cpu_threads
    from hpcrun.runtime.model import GPT, synthetic_batch
    from hpcrun.sizes import SIZES

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.set_num_threads(cpu_threads(1))  # as a one-rank hpcrun job
    dist.init_process_group("gloo", rank=0, world_size=1)
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-cost-", dir=args.dir))
    env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "bench", "localhost")
    recipe = Recipe.model_validate({"name": "c", "job": {"kind": "benchmark", "model": args.model}, "training": {"micro_batch": 2, "seq_len": 128}})
    size = SIZES[args.model]
    engine = strategies.setup(GPT(size, 128), lambda p: torch.optim.AdamW(p, lr=1e-4), recipe, env)
    counter = iter(range(10**9))

    def train_step() -> float:
        start = time.perf_counter()
        x, y = synthetic_batch(0, next(counter), 0, 2, 128, size.vocab)
        engine.micro_step(x, y, last=True)
        engine.optimizer_step()
        return time.perf_counter() - start

    train_step()  # warm-up
    step = statistics.median(train_step() for _ in range(args.steps))
    sync = ckpt.Checkpoints(tmp / "sync", env, keep=2, strategy="ddp", asynchronous=False)
    background = ckpt.Checkpoints(tmp / "async", env, keep=2, strategy="ddp", asynchronous=True)
    sync_stalls, stalls, costs, idle_writes, steps_in_flight = [], [], [], [], []
    for n in range(1, args.saves + 1):
        sync_stalls.append(sync.save(engine, n, {"step": n}))
        # asynchronous, nothing else running: the writer's own bandwidth
        background.save(engine, 2 * n - 1, {"step": 2 * n - 1})
        background.wait()
        idle_writes.append(background.write_times[-1])
        # asynchronous while training: stall, and steps slowed while the write is in flight
        stall = background.save(engine, 2 * n, {"step": 2 * n})
        spent, k = stall, 0
        while background._pending is not None:  # noqa: SLF001 - the benchmark watches the save
            spent += train_step()
            k += 1
            background.poll()
        stalls.append(stall)
        costs.append(spent - k * step)
        steps_in_flight.append(k)
    nbytes = int(statistics.median(
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) for _, path in ckpt.complete(sync.root)
    ))
    disk = statistics.median(disk_write_speed(tmp, nbytes) for _ in range(3))
    sync_stall, stall, cost = statistics.median(sync_stalls), statistics.median(stalls), statistics.median(costs)
    writer_bw = nbytes / statistics.median(idle_writes)
    interval = Recipe.model_fields["checkpoint"].default.interval
    share = lambda s: s / (s + interval * step) * 100  # noqa: E731
    mib = 2**20
    print(f"model {args.model}: checkpoint {nbytes / mib:.0f} MiB, step {step * 1000:.0f} ms, writer threads {strategies.WRITER_THREADS}")
    print(f"disk sequential write (fsync, same size): {disk / mib:.0f} MiB/s")
    print(f"synchronous save: stall {sync_stall:.2f} s = {sync_stall / step:.2f} step times, {share(sync_stall):.2f}% of wall time at interval {interval}, {nbytes / sync_stall / mib:.0f} MiB/s = {nbytes / sync_stall / disk:.2f} of disk")
    print(f"asynchronous save: stall {stall:.2f} s = {stall / step:.2f} step times (target <= 1), {share(stall):.2f}% of wall time (target < 1%)")
    print(f"asynchronous save: stall + slowed steps while writing ({statistics.median(steps_in_flight)} steps) {cost:.2f} s = {cost / step:.2f} step times, {share(cost):.2f}% of wall time")
    print(f"asynchronous writer bandwidth (idle): {writer_bw / mib:.0f} MiB/s = {writer_bw / disk:.2f} of disk (target >= 0.7)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
