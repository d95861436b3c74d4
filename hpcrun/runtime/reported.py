"""Metrics a command job's own script reports, folded into hpcrun's tables.

hpcrun does not see a command job's training loop, so the script may tell it what it measured:
one JSON object per line appended to the file named by `$HPCRUN_METRICS` (one file per attempt,
written by one process, usually rank 0):

    {"step": 120, "loss": 2.31, "lr": 0.0003, "tokens_per_s": 51200.0, "total": 1000}

`step` (completed optimizer steps, counted from the start of the run, not of the attempt) is
required; `loss`, `lr`, `grad_norm`, `tokens_per_s` fill the per-step table's columns of those
names; `time` (unix seconds, when the step ended) dates the step and gives step times (without
it a step is dated when hpcrun read it, and has no step time); `total` (the steps
the run will take) gives `hpcrun status` its ETA; any other number goes into `extra`.

While the script runs, rank 0's launcher reads new complete lines every few seconds and writes
them as per-step batches and progress.json, exactly as for built-in jobs; at the end of the
attempt they fill the results row (first and last step, step times, final loss). A line that is
not such an object is skipped with one warning per attempt: the file is the script's output,
not hpcrun's state.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import time
import typing as tp
from pathlib import Path

from hpcrun import progress
from hpcrun import steps as dataset

COLUMNS = ("loss", "lr", "grad_norm", "tokens_per_s")
KNOWN = {"step", "time", "total", *COLUMNS}
MAX_UNIX_TIME = 1e11  # seconds (the year 5138): a millisecond clock (1.7e12 today) is above it
MAX_PENDING = 100_000  # rows kept for a write that failed (a day of steps at ~1 per second)


@dataclasses.dataclass
class Line:
    step: int
    time: float | None  # the script's own; None when it gave none
    read_at: float
    total: int | None
    values: dict[str, float]  # COLUMNS present in the line
    extra: dict[str, float]


def _number(value: object) -> float | None:
    """A finite float, or None (booleans, strings, inf/nan, integers too large for a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _count(value: object) -> int | None:
    """A step or a total: an integer that fits the tables' int64 columns, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else None


def _storable(key: str) -> bool:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse(text: str, read_at: float) -> Line | None:
    """One reported line, or None when it is not a JSON object with an integer `step`. A `time`
    that is not Unix seconds (milliseconds, a step counter) is dropped: the line is timed when read."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or (step := _count(data.get("step"))) is None:
        return None
    numbers = {k: n for k, v in data.items() if (n := _number(v)) is not None}
    when = numbers.get("time")
    return Line(
        step=step, time=when if when is not None and 0 < when < MAX_UNIX_TIME else None, read_at=read_at,
        total=_count(data.get("total")),
        values={k: numbers[k] for k in COLUMNS if k in numbers},
        # a key the tables cannot store (a lone surrogate from a JSON escape) is dropped here, not
        # left to fail every later write of the batch it is in
        extra={k: v for k, v in numbers.items() if k not in KNOWN and _storable(k)},
    )


class Reported:
    """Rank 0's reader of one attempt's reported metrics: `poll` writes what is new, `lines`
    holds everything read."""

    def __init__(
        self, path: Path, results_dir: str, progress: Path, ids: dict[str, tp.Any], warn: tp.Callable[[str], None]
    ) -> None:
        self.path, self.results_dir, self.progress_path, self.ids, self.warn = path, results_dir, progress, ids, warn
        self.offset = 0
        self.lines: list[Line] = []
        self.seq = 0
        self.warned = False
        self.pending: list[dict[str, tp.Any]] = []  # rows a failed write left for the next one
        self.failing = False

    def poll(self) -> None:
        """Read the complete lines appended since the last poll; write the rows not yet written
        as one batch of step rows and refresh progress.json. A failed write is one warning until
        a write succeeds again, and its rows go with the next batch (the newest MAX_PENDING): the
        tables are the run's record, not a reason to stop its training (the lines stay for the
        results row). Rows the tables refuse for what they hold are dropped, not retried forever."""
        try:
            new = self._read()
            self.lines.extend(new)
            self.pending = (self.pending + self._rows(new))[-MAX_PENDING:]
            if not self.pending:
                return
            try:
                dataset.write_batch(self.results_dir, self.pending, self.seq)
            except OSError:
                raise  # a full disk or a lost mount: the same rows may go later
            except Exception:
                self.pending = []  # what pyarrow refuses would fail every later batch too
                raise
            self.seq += 1
            self.pending = []
            self.failing = False
            self._write_progress()
        except Exception as exc:  # training goes on
            if not self.failing:
                self.warn(f"could not record the reported steps (tried again at each flush): {exc!r}")
            self.failing = True

    def _rows(self, new: list[Line]) -> list[dict[str, tp.Any]]:
        previous = self.lines[-len(new) - 1] if len(self.lines) > len(new) else None
        rows = []
        for line in new:
            rows.append(
                {
                    **self.ids,
                    "step": line.step,
                    "time": dt.datetime.fromtimestamp(line.time or line.read_at, dt.timezone.utc),
                    **{k: line.values.get(k) for k in COLUMNS},
                    "step_time_s": _step_seconds(previous, line),
                    "step_time_min_s": None,
                    "step_time_median_s": None,
                    "step_time_max_s": None,
                    "slowest_rank": None,
                    "memory_bytes": None,
                    "extra": line.extra,
                }
            )
            previous = line
        return rows

    def step_times(self) -> list[float]:
        """Seconds per step between consecutive reported lines of this attempt."""
        times = [_step_seconds(a, b) for a, b in zip(self.lines, self.lines[1:])]
        return [t for t in times if t is not None]

    def _read(self) -> list[Line]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        now = time.time()
        lines = []
        for raw in complete.decode(errors="replace").splitlines():
            if not raw.strip():
                continue
            line = parse(raw, now)
            if line is None:
                if not self.warned:
                    self.warn(
                        f"{self.path}: skipped a line that is not a JSON object with an integer 'step': {raw[:120]!r}"
                    )
                    self.warned = True
                continue
            lines.append(line)
        return lines

    def _write_progress(self) -> None:
        last = self.lines[-1]
        total = next((line.total for line in reversed(self.lines) if line.total), None)
        seconds = progress.typical_step_s(self.step_times()[-20:])  # the recent steps, as a built-in batch
        progress.write(
            self.progress_path,
            last.step,
            total,
            last.values.get("loss"),
            last.values.get("tokens_per_s"),
            seconds,
            self.ids["job_id"],
            self.ids["attempt"],
            None,
        )


def _step_seconds(previous: Line | None, line: Line) -> float | None:
    if previous is None or previous.time is None or line.time is None or line.step <= previous.step:
        return None
    return (line.time - previous.time) / (line.step - previous.step)
