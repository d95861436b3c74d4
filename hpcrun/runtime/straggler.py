"""Slow ranks (stragglers): which rank computes persistently slower than the others, on which node.

Why not compare step times: in synchronous data-parallel training (DDP, FSDP, ZeRO) every rank's
wall step time is the same, since fast ranks wait for the slow one in the step's collectives; the
spread of per-rank step times in the steps table cannot name a straggler. Instead, at every
metrics flush (a point all ranks reach together) each rank times the same fixed amount of local
work on its own device, no collective inside (`probe`), and the times travel to rank 0 in the
flush's all_gather. A rank whose time is more than `fault.straggler_factor` times the median of
the other ranks' in PERSISTENT flushes in a row is named: its node is slow (a throttled GPU or CPU,
a noisy neighbour), whichever part of the step it slows. A single slow check is noise, not a node.

What it costs: one probe per flush (default every 30 s or 100 steps): milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

PERSISTENT = 3  # flushes in a row a rank must be slow in before it is named
CPU_SIZE, CPU_ROUNDS = 192, 24  # ~5 ms on one core
GPU_SIZE, GPU_ROUNDS = 2048, 8  # 0.14 TFLOP: ~3 ms on an H100 in fp32 (not measured: no device lent); 3 x 16 MiB


def probe(device: torch.device) -> float:
    """Seconds this rank takes for a fixed amount of local work on `device` (no collective);
    NaN when the device has no memory left for it (the check then skips this rank once)."""
    size, rounds = (GPU_SIZE, GPU_ROUNDS) if device.type == "cuda" else (CPU_SIZE, CPU_ROUNDS)
    try:
        gen = torch.Generator(device=device).manual_seed(0)  # never the training's random stream
        a = torch.rand(size, size, device=device, generator=gen)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(rounds):
            a = (a @ a).clamp_(0, 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start
    except torch.OutOfMemoryError:  # a run near its memory limit must not fail for a probe
        return math.nan


@dataclasses.dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    ratio: float  # its probe time over the median of the other ranks'

    def describe(self) -> str:
        return f"rank {self.rank} on {self.node} ({self.ratio:.1f}x the others' median)"


class Stragglers:
    """Rank 0's verdicts over one attempt: `check` every flush's probe times (one per rank)."""

    def __init__(self, factor: float, nodes: list[str]) -> None:
        self.factor, self.nodes = factor, nodes
        self.streak = [0] * len(nodes)
        self.named: dict[int, Straggler] = {}  # rank -> its latest verdict

    def check(self, seconds: list[float]) -> list[Straggler]:
        """The ranks named slow for the first time by these probe times."""
        new = []
        for rank, mine in enumerate(seconds):
            others = [t for t in seconds[:rank] + seconds[rank + 1:] if not math.isnan(t)]
            if not others or math.isnan(mine):
                continue  # no verdict this time (a probe without memory): the streak stands
            ratio = mine / statistics.median(others)
            self.streak[rank] = self.streak[rank] + 1 if ratio > self.factor else 0
            if self.streak[rank] >= PERSISTENT:
                found = Straggler(rank, self.nodes[rank], ratio)
                if rank not in self.named:
                    new.append(found)
                self.named[rank] = found
        return new

    def describe(self) -> str | None:
        """The attempt's named ranks on one line (the results row's `slow_ranks`), or None."""
        return "; ".join(s.describe() for _, s in sorted(self.named.items())) or None
