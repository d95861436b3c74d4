"""The hang watchdog: a daemon thread per rank that ends the attempt when the rank made no step
progress for `fault.hang_timeout_s`.

It depends on nothing the stuck thread holds: it reads two numbers the loop writes after every
step, and on firing it writes every thread's Python stack to this rank's log (faulthandler, which
needs no GIL-holding cooperation from the stuck thread), leaves the rank's exit record and ends
the process with EXIT_HUNG. A non-zero exit ends the job step (srun's --kill-on-bad-exit), and the
attempt is recorded and requeued like any failed one. A rank that is stopped (SIGSTOP) cannot dump
its own stack; its peers, waiting for it in a collective, fire instead. Which ranks went silent is
read from their heartbeats (hpcrun.runtime.heartbeat) by the attempt's one failure writer, once,
not by every firing rank: O(ranks) reads per hang, not O(ranks^2).

The thread must outlive its own errors: a heartbeat that cannot be written (a full or vanished
shared filesystem) is a line on stderr and the watch goes on, and once it fires the process ends
with EXIT_HUNG whatever the stack dump or the exit record raised.

Only steps are timed. The first step (compilation, the first collectives' setup) and checkpoint
saves may take far longer than a step without being hung, so neither counts against the timeout:
the clock starts at the first step's end and restarts when a save ends. A collective that never
completes in either is still ended by the process group's timeout (fault.collective_timeout_s).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
import typing as tp

from hpcrun.rundir import RunDir
from hpcrun.runtime import failure, heartbeat

EXIT_HUNG = 75
FLOOR_S = 300.0  # the derived timeout's floor: slower saves and evaluation steps are not hangs
STEP_FACTOR = 20  # the derived timeout: this many median step times (of the first MEASURED steps)
MEASURED = 5


def derived_timeout(step_times: list[float]) -> float:
    """`fault.hang_timeout_s: null`: max(300 s, 20 x the median of the first steps' times)."""
    return max(FLOOR_S, STEP_FACTOR * statistics.median(step_times))


def flight_recorder_env(run_dir: RunDir) -> None:
    """On NCCL, PyTorch's flight recorder: a ring of the last collectives per rank, dumped into
    the run directory when a collective times out. Read by the process group when it is
    created, so called before it; a user's own settings win."""
    run_dir.flight_recorder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(run_dir.flight_recorder / "rank_"))
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(run_dir.flight_recorder / "rank_"))  # the older name


class Watchdog:
    """Started by the training loop at its first step; `beat` after every step, and every save
    made inside `saving()`."""

    def __init__(
        self, run_dir: RunDir, job_id: str, attempt: int, rank: int, world_size: int, timeout_s: float | None
    ) -> None:
        self.run_dir, self.job_id, self.attempt, self.rank, self.world_size = run_dir, job_id, attempt, rank, world_size
        self.fixed = timeout_s
        self.timeout_s: float | None = timeout_s
        self.step_times: list[float] = []
        self.last = time.monotonic()
        self.last_wall = time.time()
        self.step = -1  # no step completed yet: not timed (see the module's docstring)
        self.saves = 0  # saves in progress: not timed
        self.written = 0.0
        self.beaten: float | None = None  # when the last heartbeat said this process ran (unix time)
        self.interval = heartbeat.interval(world_size)
        self.cpu_s = 0.0  # this thread's CPU time, known when it ends
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hpcrun-watchdog", daemon=True)
        self.thread.start()

    def beat(self, step: int, seconds: float) -> None:
        """Step `step` completed in `seconds`: progress. Two stores on the training thread; the
        heartbeat file is written by the watchdog's own thread."""
        self.last = time.monotonic()
        self.last_wall = time.time()
        self.step = step
        if self.timeout_s is None:
            self.step_times.append(seconds)
            if len(self.step_times) >= MEASURED:
                self.timeout_s = derived_timeout(self.step_times)

    @contextlib.contextmanager
    def saving(self) -> tp.Iterator[None]:
        """A checkpoint save: not timed, and the step clock restarts when it ends."""
        self.saves += 1
        try:
            yield
        finally:
            self.last = time.monotonic()
            self.saves -= 1

    def stop(self) -> float:
        """End the thread; returns the CPU time it used (its cost, reported by the loop)."""
        self.done.set()
        self.thread.join(5.0)
        return self.cpu_s

    def _watch(self) -> None:
        while not self.done.wait(1.0):
            try:
                timeout = self.timeout_s
                timed = self.step >= 0 and not self.saves
                if timeout is not None and timed and time.monotonic() - self.last > timeout:
                    self.fire(timeout)
                if time.monotonic() - self.written >= self.interval:
                    self.written = time.monotonic()  # a failing write is retried (and told) once an interval
                    self.beaten = heartbeat.write(self.run_dir, self.job_id, self.attempt, self.rank, self.step,
                                                self.last_wall, self.beaten)
            except Exception as exc:  # noqa: BLE001 - a guard that dies guards nothing
                self.say(f"watchdog: heartbeat not written, watching on: {type(exc).__name__}: {exc}")
        self.cpu_s = time.thread_time()

    def say(self, line: str) -> None:
        """A line on this rank's stderr; a broken stderr is not a reason to stop watching."""
        try:
            sys.stderr.write(f"[hpcrun rank {self.rank}] {line}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def fire(self, timeout: float) -> tp.NoReturn:
        """Stacks, the exit record, and the end of this process, whatever the first two raise."""
        try:
            self.say(f"hung: no step progress for {timeout:.0f} s after step {self.step + 1} "
                     f"(fault.hang_timeout_s{'' if self.fixed else ', derived'}); stacks of every thread of this rank:")
            try:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            except Exception as exc:  # noqa: BLE001 - no stacks (stderr closed, no file descriptor): still exit
                self.say(f"stacks not written: {type(exc).__name__}: {exc}")
            # the attempt's one record (hpcrun.runtime.failure) reads why this rank ended and names
            # the silent ranks; no seconds in it, so the same hang at the same step twice is the same failure
            failure.write_exit_record(self.run_dir, self.job_id, self.attempt, self.rank, failure.HUNG, self.step + 1,
                                      {})
        except Exception as exc:  # noqa: BLE001
            self.say(f"hang not recorded: {type(exc).__name__}: {exc}")
        finally:
            os._exit(EXIT_HUNG)  # the stuck main thread never reaches a clean exit
