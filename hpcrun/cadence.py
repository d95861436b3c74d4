"""When to save: the interval between disk checkpoints and between in-memory snapshots, from what
a save costs and how often the job is expected to fail. Pure data and arithmetic (the login
node's `plan` shows it; the ranks decide with it, hpcrun.runtime.cadence).

A save costs time while nothing fails (the training thread's stall, and the slower steps while
its background work runs); it saves, when a failure comes, the work since the previous one. With
a cost `C` and an expected time between failures `M`, the interval that loses the least in
expectation is Young/Daly's sqrt(2 C M). Two bounds: the interval is never so short that saves
take more than `overhead` of the wall time (C / overhead), and, cost permitting, never longer
than `max_s` (a requeue after a lost node is not left to lose hours because failures are rare).
So the same recipe saves every few minutes at a 0.13 s GPU step of a 15 GB state and at a 20 ms
CPU step of a few MB: the interval is in seconds, and steps follow from the measured step time.
"""

from __future__ import annotations

import dataclasses
import math

NODE_MTBF_HOURS = 5000.0
"""A node's expected time between interruptions when the site does not say: Llama 3's report
saw 466 interruptions in 54 days on ~2,000 nodes of 8 GPUs, about one per 5,500 node-hours."""

SECONDS_PER_GB = {"gpu": 0.25, "cpu": 5.0}
"""Before a first save is measured, its cost is estimated from the rank's state: on a GPU a copy
to pinned host memory and background work on cores training leaves idle; on CPU ranks the
background work takes the cores from training (the `heavy` model's snapshots on the test cluster
cost 3.1 s for 0.55 GB). The first measured save replaces the estimate."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """How one kind of save is spaced: every `steps` steps when the recipe says so, else by time."""

    kind: str
    """`checkpoint` or `snapshot`: what the words of `explain` name."""
    steps: int | None
    """An explicit interval in steps (the recipe's); None: decided by time (`interval_s`)."""
    overhead: float
    """The most of the wall time these saves may take."""
    mtbf_s: float
    """The job's expected time between failures, in seconds."""
    max_s: float
    """The longest interval when the cost allows it."""

    def young_daly_s(self, cost_s: float) -> float:
        return math.sqrt(2 * max(cost_s, 0.0) * self.mtbf_s)

    def interval_s(self, cost_s: float) -> float:
        """Seconds between saves that each cost `cost_s`."""
        return max(cost_s / self.overhead, min(self.young_daly_s(cost_s), self.max_s))

    def explain(self, cost_s: float, measured: bool) -> str:
        """One line: the interval chosen and why (`plan`, `status`, the rank's log)."""
        if self.steps is not None:
            return f"{self.kind}s every {self.steps} steps (the recipe's)"
        interval, young_daly = self.interval_s(cost_s), self.young_daly_s(cost_s)
        if interval > min(young_daly, self.max_s):
            why = f"so that they take at most {100 * self.overhead:g}% of the time"
        elif young_daly > self.max_s:
            why = f"the longest allowed (Young/Daly's sqrt(2 x cost x MTBF) is {duration(young_daly)})"
        else:
            why = "Young/Daly's sqrt(2 x cost x MTBF)"
        source = "measured" if measured else "estimated"
        return (
            f"{self.kind}s every {duration(interval)}: {why}; cost {cost_s:.2f} s each ({source}), "
            f"MTBF {duration(self.mtbf_s)}"
        )


def estimated_cost_s(state_bytes: float, accelerator: bool) -> float:
    """What a first save of `state_bytes` is taken to cost before one is measured."""
    return state_bytes / 1e9 * SECONDS_PER_GB["gpu" if accelerator else "cpu"]


def duration(seconds: float) -> str:
    """Seconds as a person reads them: `42.0 s`, `5.0 min`, `2.5 h` (plan, status, the rank's log)."""
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
