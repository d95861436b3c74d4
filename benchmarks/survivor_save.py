"""What tier 0 of recovery costs on the critical path of a restart: a survivor's save (hpcrun.runtime.
snapshotsurvivor) writes the live training state of a DDP rank, with no copy aside and no collective,
to node-local tmpfs as DCP does for a snapshot (`engine.write_snapshot`), before the rank exits. And
what seeding every RNG stream at every step (hpcrun.runtime.checkpoint.seed_step) costs the loop.

The state is a 1.3b model's in fp32 with AdamW's two moments (3 x 5.2 GB, 15.6 GB in ~150 tensors of
the GPT's shapes), on the GPU where there is one (else a `--gb` share of it on the CPU). Baselines in
the same run: the same bytes copied device -> host into fresh pageable memory (what any save must move)
and written by DCP with 1 and 8 writer threads. Seeding: `--steps` calls timed against the same number
of empty loop iterations.

    python benchmarks/survivor_save.py [--gb 15.6] [--dir /dev/shm] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter


def state(gb: float, device: torch.device) -> dict[str, torch.Tensor]:
    """~`gb` GB of fp32 tensors, three per weight (weight, exp_avg, exp_avg_sq), GPT-like shapes."""
    per = int(gb * 1e9 / 4 / 3)
    hidden = 2048
    tensors, left, i = {}, per, 0
    while left > 0:
        n = min(left, 4 * hidden * hidden)
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            tensors[f"{i}.{kind}"] = torch.randn(n, device=device)
        left -= n
        i += 1
    return tensors


def seed_step(seed: int, step: int, rank: int) -> None:  # hpcrun.runtime.checkpoint.seed_step's body
    value = int.from_bytes(hashlib.blake2b(f"{seed}:{step}:{rank}".encode(), digest_size=8).digest(), "little")
    torch.default_generator.manual_seed(value)  # torch.manual_seed asks every backend: ~0.3 ms, this ~3 us
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(value)
    random.seed(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=None, help="state size (default: 15.6 on a GPU, 2 on CPU)")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10000)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gb = args.gb or (15.6 if device.type == "cuda" else 2.0)
    live = state(gb, device)
    size = sum(t.numel() * t.element_size() for t in live.values()) / 1e9
    print(f"survivor's save: {size:.1f} GB in {len(live)} tensors on {device}"
          f" ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}")
    times: dict[str, list[float]] = {"copy to host": [], "dcp 1 thread": [], "dcp 8 threads": []}
    for _ in range(args.rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        host = {k: v.to("cpu") for k, v in live.items()}
        times["copy to host"].append(time.perf_counter() - began)
        del host
        for threads in (1, 8):
            target = args.dir / f"hpcrun-survivor-bench-{threads}"
            shutil.rmtree(target, ignore_errors=True)
            began = time.perf_counter()
            dcp.save(live, storage_writer=FileSystemWriter(target, thread_count=threads, sync_files=False),
                     no_dist=True)
            times[f"dcp {threads} thread{'s' if threads > 1 else ''}"].append(time.perf_counter() - began)
            shutil.rmtree(target, ignore_errors=True)
    base = statistics.median(times["copy to host"])
    for what, values in times.items():
        med = statistics.median(values)
        print(f"  {what}: median {med:.2f} s ({size / med:.1f} GB/s) over {len(values)} rounds, "
              f"spread {min(values):.2f}-{max(values):.2f} s; {med / base:.2f}x the copy to host")
    began = time.perf_counter()
    for _ in range(args.steps):
        pass
    empty = time.perf_counter() - began
    began = time.perf_counter()
    for step in range(args.steps):
        seed_step(0, step, 3)
    seeded = time.perf_counter() - began
    print(f"seeding every stream per step: {(seeded - empty) / args.steps * 1e6:.1f} us a step "
          f"({args.steps} steps; an empty loop {empty / args.steps * 1e9:.0f} ns a step)")


if __name__ == "__main__":
    main()
