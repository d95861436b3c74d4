"""When a rank saves: one kind of save's cadence (hpcrun.cadence) on one rank, with its cost
measured where it is paid.

A save's cost is the training thread's stall plus what the steps lost while its background half
(a write, a send to a peer) ran beside them: the sum, over the steps it overlapped, of each step's
excess over the median of recent steps with nothing in flight. On a GPU node that excess is
near zero; on CPU ranks sharing cores with the writer it is most of the cost, and the in-process
stall alone would hide it.

A save spaced by time is due by the wall clock: each rank casts, with the stop vote
(hpcrun.runtime.vote `StopVote`, every ~0.25 s whatever the step time), whether its clock says
the interval since the last save has passed, whether its last save is still in flight, and its
measured cost; every rank reads the MAX of those at the same step and decides alike. So the
interval comes from the slowest rank's figures, a save in flight on any rank holds the next one
back (a snapshot due then is skipped and tried again a quarter interval later; a disk checkpoint
waits for the write), and no step count planned at one step time outlives a change of pace. A
recipe's explicit interval in steps is decided by step numbers, with one all-reduce of `busy` at
each due step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
import typing as tp

import torch
import torch.distributed as dist

from hpcrun.cadence import Policy, estimated_cost_s
from hpcrun.runtime.env import DistEnv

RETRY_SHARE = 4
"""A skipped save is tried again after this fraction of its interval."""

LEAST_COST_S = 0.01
"""The cost a save is taken to have at least: a state measured at nothing (an engine whose
tensors hide their size, DeepSpeed's) must not be saved every step."""

RECENT_COSTS = 3
"""The median of the last few measured costs decides: one noisy save does not."""

BALLOT = 3
"""The integers one kind of save casts in the stop vote: due by this rank's clock, in flight, cost (us)."""


@dataclasses.dataclass
class _Flight:
    """A save whose background half is still running."""

    stall_s: float
    baseline_s: float | None
    excess_s: float = 0.0


class Cadence:
    """One kind of save (disk checkpoint or in-memory snapshot) on one rank. By time: `ballot`
    at each vote this rank casts, `wants` with what the vote agreed; by steps: `wants` at every
    step. `started` when a save began, `observe` after every step."""

    def __init__(
        self,
        policy: Policy,
        env: DistEnv,
        skips: bool,
        state_bytes: tp.Callable[[], float],
        busy: tp.Callable[[], bool],
        *,
        since_s: float = 0.0,
        costs: tp.Sequence[float] = (),
        first_allocates: bool = False,
        clock: tp.Callable[[], float] = time.monotonic,
    ) -> None:
        """`since_s`: how long ago the newest save of this kind was made (a restart from memory
        past the newest disk checkpoint: its clock keeps running). `costs`: what saves of this
        kind measured in earlier attempts of the run (their trainer state carries them), which
        replace the estimate. `first_allocates`: this attempt's first save allocates its host
        buffers on the training thread (the disk checkpoint's stager), so its cost stands only
        until a second is measured."""
        self.policy, self.env, self.skips, self.clock = policy, env, skips, clock
        self.state_bytes, self.busy = state_bytes, busy
        self.carried = list(costs)
        self.costs: list[float] = []  # measured in this attempt, one per save whose background half ended
        self.first_allocates = first_allocates
        self.skipped = 0
        self.saves: list[float] = []  # this attempt's clock at each save of this kind
        self.agreed_cost_s: float | None = None  # the slowest rank's cost, as the last vote agreed
        self._last = clock() - since_s  # the clock at the last save of this kind
        self._retry_at = -math.inf
        self._estimate_s: float | None = None
        self._clean: collections.deque[float] = collections.deque(maxlen=64)  # step times, nothing in flight
        self._flight: _Flight | None = None

    def carry(self) -> list[float]:
        """The measured costs a restart should plan from (the trainer state carries them): the
        recent ones `cost_s` uses, the one-off first save of this attempt left out while others exist."""
        own = self.costs[1:] if self.first_allocates and len(self.costs) > 1 else self.costs
        if self.carried and self.first_allocates and len(self.costs) == 1:
            own = []  # the one-off allocation's save: an earlier attempt's figures are nearer the truth
        return (self.carried + own)[-RECENT_COSTS:]

    def cost_s(self) -> tuple[float, bool]:
        """This rank's cost of one save, and whether it was measured (in this attempt or an earlier one)."""
        recent = self.carry()
        if recent:
            return max(statistics.median(recent), LEAST_COST_S), True
        if self._estimate_s is None:  # the state's size once: it does not change within an attempt
            self._estimate_s = estimated_cost_s(self.state_bytes(), self.env.device.type == "cuda")
        return max(self._estimate_s, LEAST_COST_S), False

    def interval_s(self) -> float:
        """Seconds between saves, from the agreed cost once a vote agreed one (this rank's before)."""
        cost = self.agreed_cost_s if self.agreed_cost_s is not None else self.cost_s()[0]
        return self.policy.interval_s(cost)

    def ballot(self) -> list[int]:
        """What this rank casts in the stop vote (BALLOT integers): whether its clock says a save
        of this kind is due, whether its last one is still in flight, and its cost in microseconds."""
        now = self.clock()
        due = now >= max(self._last + self.interval_s(), self._retry_at)
        return [int(due), int(self.busy()), round(self.cost_s()[0] * 1e6)]

    def wants(self, done: int, agreed: tp.Sequence[int] | None) -> bool:
        """Whether to save after step `done`, the same answer on every rank. By time: `agreed` is
        the MAX over ranks of their ballots when a vote was read at this step (None: none was).
        By steps: collective at every `policy.steps`-th step (MAX of `busy`)."""
        if self.policy.steps is not None:
            if done % self.policy.steps:
                return False
            return self._go(self._any_busy(self.busy()))
        if agreed is None:
            return False
        due, any_busy, cost_us = agreed
        self.agreed_cost_s = cost_us / 1e6
        if not due:
            return False
        if any_busy and not self.skips:
            return False  # a disk checkpoint waits for the write before it: due again at the next vote
        if any_busy:
            self._retry_at = self.clock() + self.interval_s() / RETRY_SHARE
        return self._go(bool(any_busy))

    def _go(self, any_busy: bool) -> bool:
        if any_busy and self.skips:
            self.skipped += 1
            return False
        self._last = self.clock()
        self.saves.append(self._last)
        return True

    def _any_busy(self, busy: bool) -> bool:
        if dist.is_initialized() and self.env.world_size > 1:
            tensor = torch.tensor([int(busy)], dtype=torch.int64, device=self.env.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            return bool(tensor.item())
        return busy

    @property
    def explanation(self) -> str:
        """The interval chosen and why, from the cost the last vote agreed ("" before the first)."""
        if self.policy.steps is not None:
            return self.policy.explain(0.0, measured=False)
        if self.agreed_cost_s is None:
            return ""
        return self.policy.explain(self.agreed_cost_s, self.cost_s()[1])

    def summary(self) -> str:
        """What this attempt did, after what it planned (the log, progress.json)."""
        line = self.explanation
        if self.saves:
            gaps = [b - a for a, b in zip(self.saves, self.saves[1:])]
            line += f"; {len(self.saves)} made"
            if gaps:
                line += f", {statistics.mean(gaps):.1f} s apart on average (the closest {min(gaps):.1f} s)"
        if self.costs:
            line += f", {len(self.costs)} measured at {statistics.mean(self.costs):.2f} s each"
        if self.skipped:
            line += f", {self.skipped} skipped (the one before still in flight, or the buffers not yet allocated)"
        return line

    def _baseline(self) -> float | None:
        """The median recent step with nothing in flight."""
        return statistics.median(self._clean) if self._clean else None

    def started(self, stall_s: float) -> None:
        """A save began and held the training thread `stall_s`; its background half now runs."""
        self._flight = _Flight(stall_s, self._baseline())

    def observe(self, step_s: float, busy: bool, anything_busy: bool) -> None:
        """After a step of `step_s`: whether this kind's save is still in flight, and whether any
        save was (a clean step is the baseline of the excess)."""
        flight = self._flight
        if flight is not None:
            if flight.baseline_s is not None:  # signed: noise above and below the median cancels
                flight.excess_s += step_s - flight.baseline_s
            if not busy:
                self.costs.append(flight.stall_s + max(0.0, flight.excess_s))
                self._flight = None
        if not anything_busy:
            self._clean.append(step_s)


def state_bytes(engine: tp.Any) -> float:
    """The bytes of this rank's model and optimizer state (its shards under FSDP), from tensor
    sizes alone: no state dict is built, no collective."""
    total = 0
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        total += sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    optimizer = getattr(engine, "optimizer", None)
    for state in getattr(optimizer, "state", {}).values():
        if isinstance(state, dict):
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return float(total)
