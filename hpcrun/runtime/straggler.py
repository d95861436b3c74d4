"""Slow ranks (stragglers): which rank computes persistently slower than the others, on which node.

Why not compare step times: in synchronous data-parallel training (DDP, FSDP, ZeRO) every rank's
wall step time is the same, since fast ranks wait for the slow one in the step's collectives; the
spread of per-rank step times in the steps table cannot name a straggler. Instead, at every
metrics flush (a point all ranks reach together) each rank times the same fixed amount of local
work on its own device, no collective inside (`probe`), and the times travel to rank 0 in the
flush's all_gather. A rank whose time is more than `fault.straggler_factor` times the median of
the other ranks' is slow at that check; a rank slow in at least SLOW_SHARE of its latest checks,
at least PERSISTENT of them over at least PERSISTENT_S seconds, is named: its node is slow (a
throttled GPU or CPU, a noisy neighbour), whichever part of the step it slows.

Why a share over a span, not a streak: a single slow check is noise, not a node, and so are a
few in a row when flushes come every second (a loaded machine's scheduler can delay one rank's
few milliseconds of probe several times running: seen naming an unthrottled rank on an
overloaded CI machine). But a really slow rank is not slow at every check either (a throttled
CPU's quota, a peer's probe delayed by the same load): a streak that one fast check resets was
seen never to name it over 40 s of flushes. At the default 30 s flushes the window is the last 3
checks, all of them slow: three in a row, as before.

Why 40 ms of work on a CPU, not a few: the kernel enforces a CPU quota (a cgroup's, a
container's) at scheduler ticks, 4 ms apart at HZ=250, and a process that slept may overrun its
quota by a tick and repay it afterwards. A 5 ms probe on a process held to a tenth of a CPU took
4 to 70 ms (often as fast as an unthrottled one: seen never naming it under load); a 40 ms probe
took 300 to 400 ms every time, 3x or more an unthrottled one's on the same busy machine.

What it costs: one probe per flush (default every 30 s or 1000 steps), and no more often than
keeps the probes within `fault.straggler_probe_share` of the ranks' time (default 0.5%: at a CPU
rank's ~40 ms, one every 8 s; at 4 ranks sharing 2 cores, ~80 ms and one every 16 s), measured
from the previous probe's median time on every rank, and never more often than PROBE_EVERY_S
(a GPU's few ms). At 20 ms steps and 100-step flushes the probe once took 1.6% of the training
(benchmarks/RESULTS.md). A share above PROBE_EVERY_S's (`fault.straggler_probe_share: 0.05`)
names a slow rank sooner: a verdict's window spans PERSISTENT_S, and at PROBE_EVERY_S it holds
five checks, so a share (not a streak) decides.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

PERSISTENT = 3  # the fewest checks a verdict rests on
PERSISTENT_S = 10.0  # the shortest span of checks a verdict rests on (at 30 s flushes, 3 checks span longer)
SLOW_SHARE = 0.75  # the share of those checks a rank must be slow in (of 3: all of them)
PROBE_EVERY_S = PERSISTENT_S / 4  # the least time between probes (however often flushes come): see the docstring


def probe_interval(probe_s: list[float], share: float) -> float:
    """Seconds from one probe to the next: as long as keeps the ranks' median probe within `share`
    of their time, and at least PROBE_EVERY_S. Every rank computes it from the same gathered
    times, so all agree."""
    return max(PROBE_EVERY_S, statistics.median(probe_s) / share)
CPU_SIZE, CPU_ROUNDS = 192, 192  # ~40 ms of CPU (30-40 ms here with one intra-op thread): see the docstring
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
        # per rank, its checks as (time.monotonic(), ratio), the newest last: as far back as a
        # verdict needs, no further
        self.history: list[list[tuple[float, float]]] = [[] for _ in nodes]
        self.named: dict[int, Straggler] = {}  # rank -> its latest verdict

    def check(self, seconds: list[float], now: float | None = None) -> list[Straggler]:
        """The ranks named slow for the first time by these probe times (taken at `now`)."""
        now = time.monotonic() if now is None else now
        new = []
        for rank, mine in enumerate(seconds):
            others = [t for t in seconds[:rank] + seconds[rank + 1:] if not math.isnan(t)]
            if not others or math.isnan(mine):
                continue  # no check this time (a probe without memory)
            history = self.history[rank]
            history.append((now, mine / statistics.median(others)))
            window = self._window(history, now)
            if window is None:
                continue  # too few checks, or too short a span, for a verdict
            del history[: len(history) - len(window)]
            ratios = [ratio for _, ratio in window]
            if sum(ratio > self.factor for ratio in ratios) >= SLOW_SHARE * len(ratios):
                found = Straggler(rank, self.nodes[rank], statistics.median(ratios))
                if rank not in self.named:
                    new.append(found)
                self.named[rank] = found
        return new

    @staticmethod
    def _window(history: list[tuple[float, float]], now: float) -> list[tuple[float, float]] | None:
        """The latest checks a verdict rests on: back from the newest until there are PERSISTENT of
        them spanning PERSISTENT_S; None while the history is shorter."""
        for start in range(len(history) - 1, -1, -1):
            if len(history) - start >= PERSISTENT and now - history[start][0] >= PERSISTENT_S:
                return history[start:]
        return None

    def describe(self) -> str | None:
        """The attempt's named ranks on one line (the results row's `slow_ranks`), or None."""
        return "; ".join(s.describe() for _, s in sorted(self.named.items())) or None
