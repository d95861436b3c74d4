"""When a rank saves: one kind of save's cadence (hpcrun.cadence) on one rank, with its cost
measured where it is paid.

A save's cost is the training thread's stall plus what the steps lost while its background half
(a write, a send to a peer) ran beside them: the sum, over the steps it overlapped, of each step's
excess over the median of recent steps with nothing in flight. On a GPU node that excess is
near zero; on CPU ranks sharing cores with the writer it is most of the cost, and the in-process
stall alone would hide it.

Every rank takes the same decisions at the same steps: a due step is decided by one small
all-reduce (MAX) of [busy, cost, step time], so the interval comes from the slowest rank's
figures and a snapshot still in flight on any rank is skipped by all (the background halves
meet in collectives of their own, which must pair up).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import typing as tp

import torch
import torch.distributed as dist

from hpcrun.cadence import Policy, estimated_cost_s
from hpcrun.runtime.env import DistEnv

FIRST_DECISION_STEPS = 5
"""A save spaced by time is first planned this many steps into an attempt, once step times are known."""

RETRY_SHARE = 4
"""A skipped save is tried again after this fraction of its interval."""

LEAST_COST_S = 0.01
"""The cost a save is taken to have at least: a state measured at nothing (an engine whose
tensors hide their size, DeepSpeed's) must not be saved every step."""

RECENT_COSTS = 3
"""The median of the last few measured costs decides: one noisy save does not."""


@dataclasses.dataclass
class _Flight:
    """A save whose background half is still running."""

    stall_s: float
    baseline_s: float | None
    excess_s: float = 0.0


class SaveSchedule:
    """One kind of save (disk checkpoint or in-memory snapshot) on one rank: `due`, then the
    collective `decide`; `started` when a save began, `observe` after every step."""

    def __init__(
        self, policy: Policy, env: DistEnv, skips: bool, state_bytes: tp.Callable[[], float], last: int | None = None
    ) -> None:
        """`last`: the step of the newest save of this kind this attempt starts after (the disk
        checkpoint a restart from memory did not resume from), the same on every rank."""
        self.policy, self.env, self.skips, self.state_bytes = policy, env, skips, state_bytes
        self.costs: list[float] = []  # measured, one per save whose background half ended
        self.skipped = 0
        self.explanation = policy.explain(0.0, measured=False) if policy.steps is not None else ""
        self._next: int | None = None  # by time: the step of the next decision
        self._first = True
        self._last = last  # the step of the last save of this kind
        self._clean: collections.deque[float] = collections.deque(maxlen=64)  # step times, nothing in flight
        self._flight: _Flight | None = None

    def due(self, done: int, start: int) -> bool:
        """Whether the step count `done` (an attempt that began at `start`) is a decision point;
        the same answer on every rank."""
        if self.policy.steps is not None:
            return done % self.policy.steps == 0
        if self._next is None:
            return done >= start + FIRST_DECISION_STEPS
        return done >= self._next

    def decide(self, done: int, busy: bool) -> bool:
        """Collective, at a due step: whether to save now. Also plans the next decision."""
        measured = bool(self.costs)
        cost = (
            statistics.median(self.costs[-RECENT_COSTS:]) if measured
            else estimated_cost_s(self.state_bytes(), self.env.device.type == "cuda")
        )
        any_busy, cost, step_s = self._agree(busy, cost, self._baseline() or 0.0)
        cost = max(cost, LEAST_COST_S)
        first, self._first = self._first, False
        if self.policy.steps is None:
            self.explanation = self.policy.explain(cost, measured)
            steps = max(1, math.ceil(self.policy.interval_s(cost) / step_s)) if step_s > 0 else FIRST_DECISION_STEPS
            if first:  # the first decision only plans, from the last save of this kind (or the start)
                self._next = max(done + 1, (done if self._last is None else self._last) + steps)
                return False
            if self._last is not None and done - self._last < steps:  # the last save cost more than planned
                self._next = self._last + steps
                return False
            retry = any_busy and self.skips
            self._next = done + (max(1, steps // RETRY_SHARE) if retry else steps)
        if any_busy and self.skips:
            self.skipped += 1
            return False
        self._last = done
        return True

    def _agree(self, busy: bool, cost_s: float, step_s: float) -> tuple[bool, float, float]:
        values = [int(busy), round(cost_s * 1e6), round(step_s * 1e6)]
        if dist.is_initialized() and self.env.world_size > 1:
            tensor = torch.tensor(values, dtype=torch.int64, device=self.env.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            values = [int(v) for v in tensor.tolist()]
        return bool(values[0]), values[1] / 1e6, values[2] / 1e6

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
