"""Checkpoint cost: what a save costs training, and how fast it writes against this disk's own
sequential write speed measured in the same run (one process, DDP, the built-in model, the
real `Checkpoints` class). Targets: stall <= one step time and < 1% of wall time at the
interval hpcrun's defaults choose; bandwidth >= 0.7 of the disk's.

Three ways of saving are measured side by side:
- synchronous: training waits for the whole write (what DeepSpeed engines do);
- asynchronous, stall: the time `save()` blocks (the copy of the state to host memory);
- asynchronous, bandwidth: bytes over the background write's time (after the copy), and over
  copy and write together;
- asynchronous, cost: the stall plus how much slower the steps run while the background write
  shares the CPU with them, against steps with no save in flight. On a 2-core machine the
  writer competes with training for cores; on a GPU node it does not.

Shares of wall time: a save's cost over the period between two saves (the steps between them plus
the cost). The period is the one hpcrun's defaults give (`checkpoint.interval` None: by time,
hpcrun.cadence): the interval the run's `cadence("checkpoint")` policy (the site's node MTBF, one
node) chooses for the measured cost, in steps of the measured step time as the ranks convert it
(hpcrun.runtime.cadence), the cost counted as they count it (the stall plus the slowed steps'
excess, never less than the stall; a synchronous save's is its stall). By construction that share
is at most `checkpoint.overhead` (1%); the figure says how far below it is and the cadence line
which bound set the interval. `--interval N` takes every N steps instead (`checkpoint.interval: N`;
RESULTS.md §2a/§2b quote 50, the default before 8da3b18). The saves are called directly, so no
interval enters what is measured, only the shares.

    python benchmarks/checkpoint_cost.py [--model 125m] [--saves 7] [--warmup-rounds 2] [--threads N] [--no-crc]
                                         [--site local] [--interval N]

hpcrun keeps torch.save's per-record CRC32 on; `--no-crc` turns it off for this whole process
(once, before anything is saved) to show what keeping it costs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

from scratch import scratch  # benchmarks/scratch.py


def disk_write(path: Path, nbytes: int) -> float:
    """Seconds for one sequential write of `nbytes` with fsync into a new file, as a checkpoint
    file is written (the file stays until the round ends, as kept checkpoints do)."""
    block = os.urandom(1 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes >> 20)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="125m")
    parser.add_argument("--saves", type=int, default=7, help="rounds counted")
    parser.add_argument("--warmup-rounds", type=int, default=2, help="rounds run first and not counted")
    parser.add_argument("--threads", type=int, default=None, help="DCP writer threads (default: hpcrun's)")
    parser.add_argument("--steps", type=int, default=6, help="clean steps timed before the saves")
    parser.add_argument("--no-crc", action="store_true", help="torch.save without CRC32, for comparison")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--site", default="local", help="the site whose defaults (node MTBF) space the saves")
    parser.add_argument("--interval", type=int, default=None, help="shares at every N steps instead of by time")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    from hpcrun.plan import plan
    from hpcrun.recipe import Recipe
    from hpcrun.rundir import step_dir
    from hpcrun.runtime import checkpoint as ckpt
    from hpcrun.runtime.cadence import LEAST_COST_S
    from hpcrun.runtime.env import DistEnv, cpu_threads
    from hpcrun.runtime.model import GPT, synthetic_batch
    from hpcrun.site import load_site
    from hpcrun.sizes import SIZES

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.set_num_threads(cpu_threads(1))  # as a one-rank hpcrun job
    torch.serialization.set_crc32_options(not args.no_crc)
    dist.init_process_group("gloo", rank=0, world_size=1)
    tmp = scratch("ckpt-cost-", args.dir)
    env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "bench", "localhost", "bench")
    recipe = Recipe.model_validate(
        {
            "name": "c", "job": {"kind": "benchmark", "model": args.model}, "resources": {"gpus_per_node": 1},
            "training": {"micro_batch": 2, "seq_len": 128},
            **({"checkpoint": {"interval": args.interval}} if args.interval else {}),
        }
    )
    policy = plan(load_site(args.site), recipe, "checkpoint_cost.py", "bench").cadence("checkpoint")
    size = SIZES[args.model]
    if args.threads:
        ckpt.WRITER_THREADS = args.threads
    engine = recipe.strategy.build(GPT(size, 128), lambda p: torch.optim.AdamW(p, lr=1e-4), recipe, env, None, None)
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
    sync.save(engine, 0, {"step": 0})  # warm-up, and the size every write below matches
    nbytes = sum(f.stat().st_size for f in step_dir(sync.root, 0).rglob("*") if f.is_file())
    # The disk's speed on this VM drifts (300 to 2,200 MiB/s for the same write) and the first
    # large writes of a process run slow: every round measures the disk and each way of saving
    # back to back, each ratio is taken within its round, and the first rounds are not counted.
    rows: list[dict[str, float]] = []
    for n in range(1, args.warmup_rounds + args.saves + 1):
        if n == args.warmup_rounds + 1:
            rows.clear()
        disk = nbytes / disk_write(tmp / f"disk-{n}", nbytes)
        sync_stall = sync.save(engine, n, {"step": n})
        # asynchronous, nothing else running: the writer's own bandwidth
        copy = background.save(engine, 2 * n - 1, {"step": 2 * n - 1})
        background.wait()
        idle_write = background.write_times[-1]  # from the save's start: copy, then write
        # asynchronous while training: stall, and the steps slowed while the write is in flight
        stall = background.save(engine, 2 * n, {"step": 2 * n})
        spent, k = stall, 0
        while background.busy:
            spent += train_step()
            k += 1
            background.poll()
        (tmp / f"disk-{n}").unlink()
        rows.append(
            {
                "disk": disk,
                "sync_stall": sync_stall,
                "stall": stall,
                "cost": stall + max(0.0, spent - stall - k * step),  # as Cadence.observe counts it
                "in_flight": k,
                "writer": nbytes / (idle_write - copy),
                "end_to_end": nbytes / idle_write,
            }
        )
        print(
            f"round {n}{' (warm-up)' if n <= args.warmup_rounds else ''}: disk {disk / 2**20:.0f} MiB/s, "
            f"synchronous {nbytes / sync_stall / disk:.2f} of it, "
            f"asynchronous writer {rows[-1]['writer'] / disk:.2f} of it; "
            f"asynchronous stall {stall:.2f} s, with slowed steps {rows[-1]['cost']:.2f} s ({k} steps in flight)",
            flush=True,
        )
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731

    def period(cost: float) -> tuple[int, str]:
        """Steps between saves that each cost `cost`, and why: as a rank plans them (Cadence.interval_s)."""
        cost = max(cost, LEAST_COST_S)
        if policy.steps is not None:
            return policy.steps, policy.explain(cost, measured=True)
        return max(1, math.ceil(policy.interval_s(cost) / step)), policy.explain(cost, measured=True)

    share = lambda s, cost: s / (cost + period(cost)[0] * step) * 100  # noqa: E731 - of one period's wall time
    mib = 2**20
    print(
        f"model {args.model}: checkpoint {nbytes / mib:.0f} MiB, step {step * 1000:.0f} ms, "
        f"writer threads {ckpt.WRITER_THREADS}, CRC32 {'off' if args.no_crc else 'on'}, medians of {len(rows)} rounds:"
    )
    print(f"disk sequential write (fsync, same size, new file): {med('disk') / mib:.0f} MiB/s")
    sync_stall, stall, cost = med("sync_stall"), med("stall"), med("cost")
    for name, c in (("synchronous", sync_stall), ("asynchronous", cost)):
        steps, why = period(c)
        source = "the recipe's --interval" if args.interval else f"hpcrun's defaults, site {args.site}"
        print(f"{name} save's cadence ({source}): every {steps} steps = {steps * step:.0f} s; {why}")
    print(
        f"synchronous save: stall {sync_stall:.2f} s = {sync_stall / step:.2f} step times, "
        f"{share(sync_stall, sync_stall):.3f}% of wall time at its cadence, "
        f"bandwidth {statistics.median(nbytes / r['sync_stall'] / r['disk'] for r in rows):.2f} of disk"
    )
    print(
        f"asynchronous save: stall {stall:.2f} s = {stall / step:.2f} step times (target <= 1), "
        f"{share(stall, cost):.3f}% of wall time at its cadence (target < 1%)"
    )
    print(
        f"asynchronous save: stall + steps slowed while writing ({med('in_flight')} steps) {cost:.2f} s "
        f"= {cost / step:.2f} step times, {share(cost, cost):.3f}% of wall time at its cadence"
        + ("" if args.interval else f" (by time: at most checkpoint.overhead, {100 * policy.overhead:g}%)")
    )
    print(
        f"asynchronous save, background write after the copy (idle): {med('writer') / mib:.0f} MiB/s "
        f"= {statistics.median(r['writer'] / r['disk'] for r in rows):.2f} of disk (target >= 0.7)"
    )
    print(
        f"asynchronous save, copy and write together (idle): {med('end_to_end') / mib:.0f} MiB/s "
        f"= {statistics.median(r['end_to_end'] / r['disk'] for r in rows):.2f} of disk"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
