"""Per-run measurements: step times, throughput, memory, FLOPs and MFU."""

from __future__ import annotations

import dataclasses
import resource
import statistics
import sys
import time
import typing as tp

import torch


@dataclasses.dataclass(frozen=True)
class Mark:
    """A point of the training loop's wall clock: when (time.perf_counter), and how many steps,
    saves and snapshots the attempt had made by then."""

    at: float
    steps: int
    saves: int
    snapshots: int


@dataclasses.dataclass
class Measurements:
    step_times: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    checkpoint_saves: list[float] = dataclasses.field(default_factory=list)  # training stalled, per save
    checkpoint_writes: list[float] = dataclasses.field(default_factory=list)  # start to durable, per save
    snapshot_stalls: list[float] = dataclasses.field(default_factory=list)  # training stalled, per snapshot
    snapshot_failures: int = 0  # snapshots failed on some rank, as counted once the last one ended
    restart_wait_s: float = 0.0  # waited at start for an earlier attempt's processes (hpcrun.runtime.predecessors)
    extra: dict[str, float] = dataclasses.field(default_factory=dict)
    # the loop's start, the end of its warm-up and its latest step: three marks, not one per step,
    # are all the wall-clock columns need (a run may take millions of steps)
    started: Mark | None = None
    warm: Mark | None = None
    latest: Mark | None = None

    def mark(self, warmup: int) -> None:
        """Called before the loop's first step and after each step, its save or snapshot included;
        `warmup`: the steps `summarise` leaves untimed (training.warmup_steps)."""
        mark = Mark(time.perf_counter(), len(self.step_times), len(self.checkpoint_saves), len(self.snapshot_stalls))
        self.started = self.started or mark
        if mark.steps == warmup:
            self.warm = mark
        self.latest = mark

    def unix_time(self, mark: Mark | None) -> float | None:
        """When `mark` was, as unix time (a failure's accounting compares it with other processes'
        clocks): converted once, here, so the loop keeps to one clock read per mark."""
        return None if mark is None else time.time() - (time.perf_counter() - mark.at)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak on GPU; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarise(
    m: Measurements, warmup: int, tokens_per_step: int | None, samples_per_step: int | None, world: int,
    flops_per_token: int | None, peak_tflops: float | None,
) -> dict[str, tp.Any]:
    timed = m.step_times[warmup:] if len(m.step_times) > warmup else m.step_times
    mean = statistics.fmean(timed) if timed else None
    row: dict[str, tp.Any] = {
        "steps_timed": len(timed),
        "step_time_p50_s": percentile(timed, 50),
        "step_time_p95_s": percentile(timed, 95),
        "tokens_per_s": tokens_per_step / mean if mean and tokens_per_step else None,
        "samples_per_s": samples_per_step / mean if mean and samples_per_step else None,
    }
    row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / world if row["tokens_per_s"] else None
    tflops = (
        (row["tokens_per_s_per_gpu"] * flops_per_token / 1e12)
        if flops_per_token and row["tokens_per_s_per_gpu"]
        else None
    )
    row["tflops_per_gpu"] = tflops
    row["mfu"] = tflops / peak_tflops if tflops is not None and peak_tflops else None
    row["final_loss"] = m.losses[-1] if m.losses else None
    row["checkpoint_saves"] = len(m.checkpoint_saves)
    row["checkpoint_save_s"] = statistics.fmean(m.checkpoint_saves) if m.checkpoint_saves else None
    row["checkpoint_stall_s"] = sum(m.checkpoint_saves)
    row["checkpoint_write_s"] = statistics.fmean(m.checkpoint_writes) if m.checkpoint_writes else None
    row["snapshot_stall_s"] = sum(m.snapshot_stalls)
    row["snapshot_failures"] = m.snapshot_failures
    row["restart_wait_s"] = m.restart_wait_s
    row.update(wall_clock(m, warmup, tokens_per_step))
    return row


def wall_clock(m: Measurements, warmup: int, tokens_per_step: int | None) -> dict[str, float | None]:
    """`wall_tokens_per_s` and `recovery_overhead` over the same steps as `tokens_per_s` (those
    after the warm-up, or all of them in an attempt that made no more): the columns' meaning is
    stated once, in hpcrun.results."""
    first, last = (m.warm if m.latest and m.warm and m.latest.steps > warmup else m.started), m.latest
    if first is None or last is None or last.at <= first.at or last.steps == first.steps:
        return {"wall_tokens_per_s": None, "recovery_overhead": None}
    wall = last.at - first.at
    lost = sum(m.checkpoint_saves[first.saves : last.saves]) + sum(m.snapshot_stalls[first.snapshots : last.snapshots])
    return {
        "wall_tokens_per_s": tokens_per_step * (last.steps - first.steps) / wall if tokens_per_step else None,
        "recovery_overhead": lost / wall,
    }
