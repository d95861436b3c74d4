"""What grows with the number of ranks, measured where this machine allows (gloo over loopback,
N processes on its cores): the process group's rendezvous (init_process_group through the first
barrier, c10d's TCPStore on rank 0), the per-step stop vote hpcrun adds to every step (two
int64s, the `StopVote` of hpcrun.runtime.context, measured here as a blocking all-reduce: the
job reads it a step late), and the files one DCP checkpoint save writes (one per rank, plus
metadata). Printed per world size, with the slope per added rank, for
benchmarks/RESULTS.md's "on paper" section.

    python benchmarks/collective_scale.py [--worlds 2,4,8] [--reduces 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from scratch import scratch  # benchmarks/scratch.py


def rank_main(rank: int, world: int, port: int, reduces: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    began = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
    rendezvous = time.perf_counter() - began
    flag = torch.zeros(2, dtype=torch.int64)
    for _ in range(20):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    times = []
    for _ in range(reduces):
        start = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        times.append(time.perf_counter() - start)
    ckpt = Path(out) / "ckpt"
    state = {f"rank{rank}.weight": torch.randn(256, 256)}  # each rank's own shard, as FSDP/ZeRO hold them
    dcp.save(state, checkpoint_id=str(ckpt))
    dist.barrier()
    if rank == 0:
        files = sum(1 for p in ckpt.rglob("*") if p.is_file())
        Path(out, "result.json").write_text(
            json.dumps({"rendezvous_s": rendezvous, "reduce_us": [t * 1e6 for t in times], "files": files})
        )
    dist.destroy_process_group()


def measure(world: int, reduces: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(dir=scratch("collectives-"))
    mp.spawn(rank_main, args=(world, 29500 + world + os.getpid() % 500, reduces, out), nprocs=world)
    data = json.loads(Path(out, "result.json").read_text())
    us = sorted(data["reduce_us"])
    return {
        "world": world,
        "rendezvous_s": data["rendezvous_s"],
        "reduce_p50_us": statistics.median(us),
        "reduce_p90_us": us[int(0.9 * len(us))],
        "files": data["files"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--reduces", type=int, default=300)
    args = parser.parse_args()
    rows = [measure(int(w), args.reduces) for w in args.worlds.split(",")]
    print(f"gloo over loopback on {os.cpu_count()} cores (ranks beyond the cores share them)")
    print("| ranks | rendezvous (init + barrier) | stop-flag all-reduce p50 | p90 | files per DCP save |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['world']} | {r['rendezvous_s']:.2f} s | {r['reduce_p50_us']:.0f} µs "
            f"| {r['reduce_p90_us']:.0f} µs | {r['files']} |"
        )
    first, last = rows[0], rows[-1]
    span = last["world"] - first["world"]
    if span:
        print(
            f"slope per added rank: rendezvous {(last['rendezvous_s'] - first['rendezvous_s']) / span * 1e3:.1f} ms, "
            f"all-reduce p50 {(last['reduce_p50_us'] - first['reduce_p50_us']) / span:.1f} µs, "
            f"files {(last['files'] - first['files']) / span:.1f}"
        )


if __name__ == "__main__":
    main()
