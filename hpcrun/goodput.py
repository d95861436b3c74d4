"""Per-fault accounting and a run's goodput, from its results rows alone.

A failed attempt's row says how long its failure took to notice (`detect_s`: from its last
completed step to the first rank that noticed, hpcrun.runtime.failure). The attempt that resumes
after it says how long the restart took (`restart_s`: from that notice, or from the allocation's
start after a requeue, to its own first step) and what it trained again (`recomputed_steps`,
`recompute_s`): rows are written once, and only the next attempt knows when it got going.
`goodput` sums a run's rows: training time over wall time, and the seconds lost by cause.

Pure and torch-free: `hpcrun status` and the report run on login nodes."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import typing as tp

RECOVERY_COLUMNS = ("restart_s", "recomputed_steps", "recompute_s")
# what `goodput` reads of a run's rows
COLUMNS = ("start_time", "end_time", "status", "first_step", "last_step", "step_time_p50_s", "detect_s", "restart_s",
           "recompute_s")


def detect_s(progressed: float | None, noticed: float) -> float | None:
    """Seconds from the last sign of progress (unix time; None: no step completed, or nothing said
    when) to the failure's notice."""
    return None if progressed is None else max(0.0, noticed - progressed)


def restart_columns(
    previous: tp.Any, first_step_at: float | None, allocation_start: float | None, start_step: int,
    last_step: int, step_time_s: float | None,
) -> dict[str, tp.Any]:
    """An attempt's `restart_s`, `recomputed_steps` and `recompute_s` after the failed attempt
    whose record (state.json's "failure": `detected`, `reached`) is `previous` (None: the previous
    attempt did not fail, or is another job's). `first_step_at`: when this attempt's first step
    began (unix time); `allocation_start`: when this start of the job began (the batch script's
    line), which after a requeue is later than the notice: the wait before it is the queue's.
    Only steps this attempt ran count as recomputed (it may fail again before catching up)."""
    out: dict[str, tp.Any] = dict.fromkeys(RECOVERY_COLUMNS)
    if not isinstance(previous, dict):
        return out
    detected = _num(previous.get("detected"))
    if detected is not None and first_step_at is not None:
        began = max(detected, allocation_start) if allocation_start is not None else detected
        out["restart_s"] = max(0.0, first_step_at - began)
    reached = previous.get("reached")
    if isinstance(reached, int) and not isinstance(reached, bool):
        again = max(0, min(reached, last_step) - start_step)
        out["recomputed_steps"] = again
        out["recompute_s"] = again * step_time_s if step_time_s is not None else None
    return out


@dataclasses.dataclass(frozen=True)
class Goodput:
    """A run's wall time (first attempt's start to last attempt's end), the part of it spent
    training new steps, and the seconds lost by cause. What is lost to none of these (saves, the
    first start-up, writing a failure's record) is wall minus the rest."""

    wall_s: float
    training_s: float
    detect_s: float
    restart_s: float
    recompute_s: float
    queue_s: float
    failures: int

    @property
    def goodput(self) -> float | None:
        return self.training_s / self.wall_s if self.wall_s > 0 else None

    def line(self) -> str:
        """What `hpcrun status RUN` prints."""
        ratio = "–" if self.goodput is None else f"{self.goodput:.2f}"
        return (
            f"goodput {ratio}: lost {self.detect_s:.0f} s detecting, {self.restart_s:.0f} s restarting, "
            f"{self.recompute_s:.0f} s recomputing, {self.queue_s:.0f} s in the queue"
        )


def goodput(rows: tp.Iterable[tp.Mapping[str, tp.Any]]) -> Goodput | None:
    """The run's goodput from its attempts' rows (dicts, or pandas records: missing values may
    be None, NaN, pd.NA or NaT). An attempt trains (last_step - first_step) x its median step
    time, less what it recomputed; the queue is each gap between consecutive attempts less the
    next one's restart_s, which covers the gap after a failure (after a requeue it also holds the
    new attempt's start-up, so the queue is low by those seconds). None: no row has both times."""
    attempts = sorted(
        (dict(row) for row in rows if _time(row.get("start_time")) or _time(row.get("end_time"))),
        key=lambda r: _time(r.get("start_time")) or _time(r.get("end_time")) or 0.0,
    )
    starts = [t for r in attempts if (t := _time(r.get("start_time"))) is not None]
    ends = [t for r in attempts if (t := _time(r.get("end_time"))) is not None]
    if not starts or not ends:
        return None
    training = detect = restart = recompute = queue = 0.0
    for i, row in enumerate(attempts):
        first, last, step_s = _num(row.get("first_step")), _num(row.get("last_step")), _num(row.get("step_time_p50_s"))
        redone = _num(row.get("recompute_s")) or 0.0
        if first is not None and last is not None and step_s is not None:
            training += max(0.0, (last - first) * step_s - redone)
        detect += _num(row.get("detect_s")) or 0.0
        restart += _num(row.get("restart_s")) or 0.0
        recompute += redone
        if i:
            ended, began = _time(attempts[i - 1].get("end_time")), _time(row.get("start_time"))
            if ended is not None and began is not None:
                queue += max(0.0, began - ended - (_num(row.get("restart_s")) or 0.0))
    failures = sum(1 for r in attempts if r.get("status") == "failed")
    return Goodput(max(ends) - min(starts), training, detect, restart, recompute, queue, failures)


def _num(value: tp.Any) -> float | None:
    """A number, or None for any missing value (None, NaN, pandas' NA) or non-number."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def _time(value: tp.Any) -> float | None:
    """A datetime's unix time; None for a missing one (pandas' NaT is a datetime that has none)."""
    if not isinstance(value, dt.datetime):
        return None
    try:
        return value.timestamp()
    except (ValueError, OverflowError):
        return None
