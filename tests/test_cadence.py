"""How saves are spaced (hpcrun.cadence, hpcrun.runtime.cadence): by measured cost and expected
time between failures, in seconds, bounded by the wall clock, agreed across ranks; a snapshot due
while the last is in flight is skipped, not waited for, and a disk checkpoint waits for its write.

The property tests run a simulated step-time trace through the real Cadence and the real
StopVote on a simulated clock, as the training loop (hpcrun.runtime.context) drives them."""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import pytest
import torch

from hpcrun.cadence import Policy
from hpcrun.runtime.cadence import BALLOT, Cadence
from hpcrun.runtime.env import DistEnv
from hpcrun.runtime.vote import StopVote
from hpcrun.signals import SignalFlag

HOUR = 3600.0
ENV = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "local", "local", "local")


def policy(
    steps: int | None = None, mtbf_h: float = 5000.0, max_min: float = 5.0, kind: str = "snapshot"
) -> Policy:
    return Policy(kind, steps, overhead=0.01, mtbf_s=mtbf_h * HOUR, max_s=max_min * 60)


def test_the_interval_is_young_daly_within_the_budget_and_the_cap() -> None:
    assert policy(mtbf_h=10).interval_s(1.0) == pytest.approx(math.sqrt(2 * 1.0 * 36000))  # Young/Daly, 268 s
    assert policy(mtbf_h=1).interval_s(1.0) == pytest.approx(100.0)  # Young/Daly's 85 s would cost 1.2%
    assert policy(mtbf_h=5000).interval_s(0.6) == pytest.approx(300.0)  # rare failures: the longest allowed
    assert policy(mtbf_h=5000).interval_s(12.4) == pytest.approx(1240.0)  # a 12 s save: 1% beats the cap
    assert "at most 1% of the time" in policy(mtbf_h=5000).explain(12.4, measured=True)
    assert "the longest allowed" in policy(mtbf_h=5000).explain(0.6, measured=True)
    assert "every 7 steps (the recipe's)" in policy(steps=7).explain(0.6, measured=True)


class Recorder:
    """What the vote asks the step recorder: never a flush, never a probe."""

    def due(self, ahead: int = 0) -> bool:
        return False

    def probe_due(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class Save:
    """What one kind of save costs in the simulation."""

    stall_s: float = 0.01
    """The training thread's part."""
    write_s: float = 0.5
    """The background half, after the stall."""
    first_extra_s: float = 0.0
    """More stall at this kind's first save (a stager's one-off allocation)."""


DISK = Save(stall_s=1.0)  # 1 s: Young/Daly's 100 minutes, past the 30-minute cap
SNAPSHOT = Save()


@dataclasses.dataclass
class Rank:
    """One simulated rank: its clock, its two schedules, when each kind's save in flight ends."""

    now: float = 0.0
    ends: dict[str, float] = dataclasses.field(default_factory=dict)
    kinds: list[Cadence] = dataclasses.field(default_factory=list)

    def busy(self, kind: str) -> tp.Callable[[], bool]:
        return lambda: self.now < self.ends.get(kind, -1.0)


@dataclasses.dataclass
class Trace:
    """Where each rank saved: (step, simulated time) per kind, of rank 0."""

    saves: dict[str, list[tuple[int, float]]]
    ranks: list[Rank]

    def times(self, kind: str) -> list[float]:
        return [t for _, t in self.saves[kind]]

    def gaps(self, kind: str) -> list[float]:
        times = self.times(kind)
        return [b - a for a, b in zip(times, times[1:])]


def simulate(
    step_s: tp.Callable[[int, float], float],
    seconds: float,
    disk: Save = DISK,
    memory: Save | None = SNAPSHOT,
    ready_after_s: float = 0.0,
    ranks: int = 1,
    stall_factor: tp.Callable[[int], float] = lambda rank: 1.0,
    disk_max_min: float = 30.0,
    costs: tp.Sequence[float] = (),
) -> Trace:
    """Train until the simulated clock reaches `seconds`: each step takes `step_s(step, now)`, disk
    checkpoints and snapshots as the loop decides them (the MAX of the ranks' ballots read at each
    vote, as the vote's all-reduce gives), each costing its stall on the training thread (times
    `stall_factor(rank)`) and its write beside training. The ranks' clocks meet at every step (the
    gradients' all-reduce waits for the slowest). Snapshots count as in flight until
    `ready_after_s` (their buffers allocated aside)."""
    vote = StopVote(ENV, SignalFlag())
    group = [Rank() for _ in range(ranks)]
    for rank in group:
        rank.ends["snapshot"] = ready_after_s

        def clock(rank: Rank = rank) -> float:
            return rank.now

        rank.kinds = [
            Cadence(policy(max_min=disk_max_min, kind="checkpoint"), ENV, skips=False,
                         state_bytes=lambda: 1e8, busy=rank.busy("checkpoint"), clock=clock,
                         first_allocates=True, costs=costs),
        ]
        if memory is not None:
            rank.kinds.append(
                Cadence(policy(kind="snapshot"), ENV, skips=True, state_bytes=lambda: 1e8,
                             busy=rank.busy("snapshot"), clock=clock)
            )
    saves: dict[str, list[tuple[int, float]]] = {"checkpoint": [], "snapshot": []}
    done = 0
    total = 10**9
    while group[0].now < seconds:
        done += 1
        t = step_s(done, group[0].now)
        met = max(rank.now for rank in group) + t
        for rank in group:
            t, rank.now = met - rank.now, met  # a rank that stalled longer made the others wait
        agreed = vote.read(done, total, t)
        ballots = list(agreed.ballots) if agreed.ballots else None
        for rank in group:
            anything = any(k.busy() for k in rank.kinds)
            for kind in rank.kinds:
                kind.observe(t, kind.busy(), anything)
        decisions = []
        for number, rank in enumerate(group):
            decided = []
            for i, kind in enumerate(rank.kinds):
                wants = kind.wants(done, ballots and ballots[i * BALLOT:(i + 1) * BALLOT])
                decided.append(wants)
                if wants:
                    save = disk if kind.policy.kind == "checkpoint" else memory
                    assert save is not None
                    assert not kind.busy(), f"a {kind.policy.kind} began while the last was in flight"
                    stall = save.stall_s * stall_factor(number) + (save.first_extra_s if not kind.saves[:-1] else 0.0)
                    rank.now += stall
                    rank.ends[kind.policy.kind] = rank.now + save.write_s
                    kind.started(stall)
                    if rank is group[0]:
                        saves[kind.policy.kind].append((done, rank.now))
                    break  # one save a step: a disk checkpoint's step takes no snapshot
            decisions.append(decided)
        assert all(d == decisions[0] for d in decisions), f"ranks disagree at step {done}: {decisions}"
        # the vote: MAX over ranks, as the all-reduce gives it
        vote.cast(done, total, Recorder(), lambda: [
            max(col) for col in zip(*([b for k in rank.kinds for b in k.ballot()] for rank in group))
        ])
    return Trace(saves, group)


def test_saves_are_spaced_by_the_clock_whatever_the_step_time() -> None:
    """Over three hours at a 20 ms step or a 1.3 s step, snapshots come every 5 minutes (the cap)
    and disk checkpoints every 30, within one vote's spacing: no step count stands in for either."""
    for step in (0.02, 1.3):
        trace = simulate(lambda done, now, step=step: step, 3 * HOUR)
        assert len(trace.saves["checkpoint"]) == 5, trace.saves["checkpoint"]  # at 30, 60, ..., 150 minutes
        assert all(30 * 60 <= g <= 30 * 60 + 2 * step + 1.0 for g in trace.gaps("checkpoint")), trace.gaps("checkpoint")
        snapshots = trace.gaps("snapshot")
        assert snapshots and all(g <= 300 + 2 * step + 1.0 for g in snapshots), max(snapshots)
        assert min(snapshots) >= 300 - 2 * step - 1.0


def test_slow_buffer_allocation_does_not_start_a_save_every_few_steps() -> None:
    """The first snapshot's buffers take 40 s (every rank busy from the first step: one rank per
    node), disk writes take 5 s: the old loop, seeing no step time, checkpointed every 5 steps for
    the rest of the attempt. Now the first disk save comes after its interval and the rest follow it."""
    trace = simulate(lambda done, now: 0.05, 2 * HOUR, disk=Save(stall_s=1.0, write_s=5.0), ready_after_s=40.0)
    disk = trace.saves["checkpoint"]
    assert len(disk) == 3 and disk[0][1] >= 30 * 60, disk
    assert trace.times("snapshot")[0] >= 300
    assert trace.ranks[0].kinds[1].skipped == 0, "nothing was due while the buffers were allocated"
    slow = simulate(lambda done, now: 0.05, 1200, ready_after_s=700.0)
    assert slow.ranks[0].kinds[1].skipped >= 1 and slow.times("snapshot")[0] >= 700


def test_a_write_longer_than_the_interval_is_waited_for_not_stacked() -> None:
    """Disk writes of 45 minutes against a 30-minute cap: each checkpoint starts once the one
    before is written (never two in flight), never at a fixed small step count."""
    trace = simulate(lambda done, now: 0.1, 4 * HOUR, disk=Save(write_s=45 * 60.0), memory=None)
    gaps = trace.gaps("checkpoint")
    assert gaps and all(45 * 60 <= g <= 45 * 60 + 1.0 for g in gaps), gaps


@pytest.mark.parametrize("factor", [20.0, 0.1])
def test_step_time_rising_or_falling_tenfold_keeps_the_wall_clock_bounds(factor: float) -> None:
    """The issue's trace: steps go from 0.1 s to 2.0 s at t = 1,000 s (and the other way): no gap
    between snapshots exceeds the 5-minute cap, nor between checkpoints the 30-minute one, by more
    than one vote's spacing."""
    first = 0.1 if factor > 1 else 2.0
    trace = simulate(lambda done, now: first if now < 1000 else first * factor, 2 * HOUR)
    slowest = max(first, first * factor)
    assert max(trace.gaps("snapshot")) <= 300 + 2 * slowest + 1.0, max(trace.gaps("snapshot"))
    assert trace.times("checkpoint")[0] <= 30 * 60 + 2 * slowest + 1.0
    assert max(trace.gaps("checkpoint")) <= 30 * 60 + 2 * slowest + 1.0


def test_ranks_agree_though_their_clocks_and_costs_differ() -> None:
    """Four ranks, one of which stalls 30% longer at each snapshot: the interval follows the slowest
    rank's cost, which the vote's MAX gives every rank (each rank's decision reads only what the
    vote agreed, so all decide alike: simulate checks it)."""
    expensive = Save(stall_s=20.0, write_s=1.0)  # 20 s: 1% allows one every 2,000 s, past the 5-minute cap
    trace = simulate(
        lambda done, now: 0.1, 3 * HOUR, memory=expensive, ranks=4, stall_factor=lambda rank: 1.3 if rank == 3 else 1.0,
    )
    gaps = trace.gaps("snapshot")[1:]  # the first follows the estimate
    assert gaps and all(2600 <= g <= 2600 + 1.0 + 26 for g in gaps), gaps


def test_the_first_disk_save_s_one_off_allocation_does_not_stand_for_the_rest() -> None:
    """The first checkpoint of an attempt stalls 30 s more (its stager pins its buffers): the cost
    that spaces the next ones is the second's, not the first's."""
    trace = simulate(lambda done, now: 0.1, 3 * HOUR, disk=Save(stall_s=10.0, write_s=1.0, first_extra_s=30.0))
    disk = trace.ranks[0].kinds[0]
    assert disk.costs[0] >= 40 and disk.cost_s()[0] < 12
    assert "cost 10." in disk.explanation, disk.explanation


def test_measured_costs_carried_into_a_restart_replace_the_estimate() -> None:
    """An earlier attempt measured 0.2 s a checkpoint of a state estimated at 5 s (1 GB on CPU
    ranks): the restart plans from 0.2 s, and its first save's one-off allocation does not count."""
    fresh = Cadence(policy(kind="checkpoint"), ENV, skips=False, state_bytes=lambda: 1e9, busy=lambda: False)
    assert fresh.cost_s() == (5.0, False)
    carried = Cadence(
        policy(kind="checkpoint"), ENV, skips=False, state_bytes=lambda: 1e9, busy=lambda: False,
        costs=[0.2, 0.2], first_allocates=True,
    )
    assert carried.cost_s() == (pytest.approx(0.2), True)
    carried.started(30.0)
    carried.observe(0.1, busy=False, anything_busy=False)
    assert carried.cost_s() == (pytest.approx(0.2), True)
    assert carried.carry() == [0.2, 0.2], "the one-off save is not carried into the next restart either"
    alone = Cadence(
        policy(kind="checkpoint"), ENV, skips=False, state_bytes=lambda: 1e9, busy=lambda: False, first_allocates=True,
    )
    alone.started(40.0)
    alone.observe(0.1, busy=False, anything_busy=False)
    assert alone.carry() == [40.0], "with nothing else measured, the one-off save is the best figure there is"


def test_the_cost_counts_the_steps_slowed_beside_the_background_half() -> None:
    schedule = Cadence(policy(), ENV, skips=True, state_bytes=lambda: 0.0, busy=lambda: False)
    for _ in range(10):
        schedule.observe(0.05, busy=False, anything_busy=False)
    schedule.started(0.1)
    schedule.observe(0.08, busy=True, anything_busy=True)  # 30 ms slower while the copy is written
    schedule.observe(0.06, busy=True, anything_busy=True)
    schedule.observe(0.05, busy=False, anything_busy=False)  # done during this step
    assert schedule.costs == [pytest.approx(0.1 + 0.03 + 0.01)]


def test_a_snapshot_due_while_the_last_is_in_flight_is_skipped() -> None:
    busy = [False]
    schedule = Cadence(policy(steps=2), ENV, skips=True, state_bytes=lambda: 0.0, busy=lambda: busy[0])
    assert [d for d in range(1, 7) if d % 2 == 0 and schedule.wants(d, None)] == [2, 4, 6]
    busy[0] = True
    assert not schedule.wants(8, None) and schedule.skipped == 1
    assert not schedule.wants(9, None) and schedule.skipped == 1, "not a due step"
    disk = Cadence(policy(steps=2), ENV, skips=False, state_bytes=lambda: 0.0, busy=lambda: True)
    assert disk.wants(2, None), "a disk checkpoint due by steps is never skipped: it waits for the one before"


def test_the_first_save_by_time_waits_for_its_estimated_cost() -> None:
    """Before anything is measured the cost is estimated from the state's size: 0.55 GB on CPU
    ranks (5 s per GB) is first snapshotted no sooner than 100 x 2.75 s into the run."""
    now = [0.0]
    schedule = Cadence(
        policy(max_min=1.0), ENV, skips=True, state_bytes=lambda: 0.55e9, busy=lambda: False, clock=lambda: now[0]
    )
    now[0] = 274.0
    assert schedule.ballot()[0] == 0
    now[0] = 276.0
    assert schedule.ballot()[0] == 1
    assert schedule.wants(1000, schedule.ballot()) and "estimated" in schedule.explanation


def test_a_restart_from_memory_keeps_the_disk_clock() -> None:
    """An attempt that resumed from an in-memory snapshot taken 40 minutes of training after the
    newest disk checkpoint: the disk's 30-minute interval ran out long ago, so it saves at its first
    vote, not an interval after the restart (a burst of faults would never reach the disk)."""
    disk = Cadence(
        policy(kind="checkpoint", max_min=30), ENV, skips=False, state_bytes=lambda: 0.55e9, busy=lambda: False,
        since_s=40 * 60,
    )
    assert disk.wants(501, disk.ballot())
    assert disk.ballot()[0] == 0, "and then an interval later"
