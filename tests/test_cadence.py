"""How saves are spaced (hpcrun.cadence, hpcrun.runtime.schedule): by measured cost and expected
time between failures, in seconds, so that one default serves a 20 ms CPU step and a 0.13 s GPU
step of a 15 GB state; a snapshot due while the last is in flight is skipped, not waited for."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrun.cadence import Policy
from hpcrun.runtime.env import DistEnv
from hpcrun.runtime.schedule import FIRST_DECISION_STEPS, SaveSchedule

HOUR = 3600.0
ENV = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "local", "local", "local")


def policy(steps: int | None = None, mtbf_h: float = 5000.0, max_min: float = 5.0) -> Policy:
    return Policy("snapshot", steps, overhead=0.01, mtbf_s=mtbf_h * HOUR, max_s=max_min * 60)


def test_the_interval_is_young_daly_within_the_budget_and_the_cap() -> None:
    assert policy(mtbf_h=10).interval_s(1.0) == pytest.approx(math.sqrt(2 * 1.0 * 36000))  # Young/Daly, 268 s
    assert policy(mtbf_h=1).interval_s(1.0) == pytest.approx(100.0)  # Young/Daly's 85 s would cost 1.2%
    assert policy(mtbf_h=5000).interval_s(0.6) == pytest.approx(300.0)  # rare failures: the longest allowed
    assert policy(mtbf_h=5000).interval_s(12.4) == pytest.approx(1240.0)  # a 12 s save: 1% beats the cap
    assert "at most 1% of the time" in policy(mtbf_h=5000).explain(12.4, measured=True)
    assert "the longest allowed" in policy(mtbf_h=5000).explain(0.6, measured=True)
    assert "every 7 steps (the recipe's)" in policy(steps=7).explain(0.6, measured=True)


def ran(schedule: SaveSchedule, step_s: float, cost_s: float, steps: int) -> list[int]:
    """The steps at which `schedule` saved over `steps` steps of `step_s`, each save costing
    `cost_s` on the training thread and its background half done by the next step."""
    saved = []
    for done in range(1, steps + 1):
        schedule.observe(step_s, busy=False, anything_busy=False)
        if schedule.due(done, 0) and schedule.decide(done, busy=False):
            saved.append(done)
            schedule.started(cost_s)
    return saved


@pytest.mark.parametrize("step_s, cost_s", [(0.02, 0.004), (0.13, 0.6), (0.13, 12.4)])
def test_one_default_for_a_cpu_step_and_a_gpu_step(step_s: float, cost_s: float) -> None:
    """Over three hours of training, saves cost at most 1% of the time whatever the step and the
    state once the first has been measured, and come at least every 5 minutes where that is cheap
    enough: 12.4 s every 25 steps (the snapshot GPU run of the first issue) was 160% of the step time."""
    steps = round(3 * HOUR / step_s)
    saved = ran(SaveSchedule(policy(), ENV, skips=True, state_bytes=lambda: 1e9), step_s, cost_s, steps)
    assert saved[0] > FIRST_DECISION_STEPS
    gaps = [(b - a) * step_s for a, b in zip(saved, saved[1:])]
    assert cost_s * (len(saved) - 1) <= 0.0101 * (steps - saved[0]) * step_s
    measured = gaps[1:]  # the first gap follows the estimate (1 GB: 5 s on CPU ranks), the rest the measured cost
    assert min(measured) >= min(300.0, cost_s / 0.01) - step_s
    assert max(measured) <= max(300.0, cost_s / 0.01) + step_s


def test_the_cost_counts_the_steps_slowed_beside_the_background_half() -> None:
    schedule = SaveSchedule(policy(), ENV, skips=True, state_bytes=lambda: 0.0)
    for _ in range(10):
        schedule.observe(0.05, busy=False, anything_busy=False)
    schedule.started(0.1)
    schedule.observe(0.08, busy=True, anything_busy=True)  # 30 ms slower while the copy is written
    schedule.observe(0.06, busy=True, anything_busy=True)
    schedule.observe(0.05, busy=False, anything_busy=False)  # done during this step
    assert schedule.costs == [pytest.approx(0.1 + 0.03 + 0.01)]


def test_a_snapshot_due_while_the_last_is_in_flight_is_skipped() -> None:
    schedule = SaveSchedule(policy(steps=2), ENV, skips=True, state_bytes=lambda: 0.0)
    assert [d for d in range(1, 7) if schedule.due(d, 0)] == [2, 4, 6]
    assert schedule.decide(2, busy=False)
    assert not schedule.decide(4, busy=True) and schedule.skipped == 1
    assert schedule.decide(6, busy=False)
    disk = SaveSchedule(policy(steps=2), ENV, skips=False, state_bytes=lambda: 0.0)
    assert disk.decide(2, busy=True), "a disk checkpoint due is never skipped: it waits for the one before"


def test_the_first_save_by_time_waits_for_its_estimated_cost() -> None:
    """Before anything is measured the cost is estimated from the state's size: 0.55 GB on CPU
    ranks (5 s per GB) is first snapshotted no sooner than 100 x 2.75 s into the run."""
    schedule = SaveSchedule(policy(), ENV, skips=True, state_bytes=lambda: 0.55e9)
    saved = ran(schedule, 0.3, 3.1, round(2 * HOUR / 0.3))
    assert saved[0] * 0.3 >= 275 and "estimated" not in schedule.explanation


def test_a_restart_from_memory_keeps_the_disk_clock() -> None:
    """An attempt that resumed from an in-memory snapshot at step 500, past a disk checkpoint of
    step 100: the disk's interval (300 steps of 1 s) ran out long ago, so it saves at its first
    chance, not an interval after the restart (a burst of faults would never reach the disk)."""
    disk = SaveSchedule(policy(), ENV, skips=False, state_bytes=lambda: 0.55e9, last=100)
    saved = []
    for done in range(501, 1200):
        disk.observe(1.0, busy=False, anything_busy=False)
        if disk.due(done, 500) and disk.decide(done, busy=False):
            saved.append(done)
            disk.started(0.5)
    assert saved[:2] == [506, 806], saved
