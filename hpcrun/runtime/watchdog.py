"""The hang watchdog: a daemon thread per rank that ends the attempt when the rank made no step
progress for `fault.hang_timeout_s` (by default derived from the job's own step times), or when
the rank before it in the pulse ring (hpcrun.runtime.pulse) fell silent for `fault.peer_timeout_s`.

It depends on nothing the stuck thread holds: it reads two numbers the loop writes after every
step, and on firing it writes every thread's Python stack to this rank's log (faulthandler, which
needs no GIL-holding cooperation from the stuck thread), leaves the rank's exit record and ends
the process with EXIT_HUNG, after `on_end` (where every rank holds the same state, the survivor's
save of hpcrun.runtime.snapshotsurvivor). A non-zero exit ends the job step (srun's
--kill-on-bad-exit, or the batch script's watcher), and the attempt is recorded and restarted or
requeued like any failed one. A rank that is stopped (SIGSTOP) cannot dump its own stack; its
peers, waiting for it in a collective, fire instead. Which ranks went silent is
read from their heartbeats (hpcrun.runtime.heartbeat) by the attempt's one failure writer, once,
not by every firing rank: O(ranks) reads per hang, not O(ranks^2).

The thread must outlive its own errors: a heartbeat that cannot be written (a full or vanished
shared filesystem) is a line on stderr and the watch goes on, and once it fires the process ends
with EXIT_HUNG whatever the stack dump or the exit record raised.

Only steps are timed. The first step (compilation, the first collectives' setup) and checkpoint
saves may take far longer than a step without being hung, so neither counts against the timeout:
the clock starts at the first step's end and restarts when a save ends. A collective that never
completes in either is still ended by the process group's timeout (fault.collective_timeout_s).
The derived timeout follows the job: FACTOR times the slowest of the recent steps, never under
FLOOR_S; and while the training thread keeps a core busy (evaluation, compiling, CPU data work) it
is working, not hung, so the clock restarts. A rank that stopped or died is the pulse ring's to
see, in seconds: this timeout is for a live rank stuck waiting.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import sys
import threading
import time
import typing as tp
from pathlib import Path

from hpcrun.rundir import RunDir
from hpcrun.runtime import failure, heartbeat
from hpcrun.runtime.pulse import Pulse

EXIT_HUNG = 75
FLOOR_S = 120.0  # the derived timeout's floor: a data stall, or rank 0's evaluation while the others wait, shorter
STEP_FACTOR = 5  # the derived timeout: this many times the slowest recent step (NVRx's launcher uses 5)
RECENT = 100  # steps whose slowest sets the derived timeout
BUSY_SHARE = 0.05  # a training thread on a core this share of the time (a loaded machine gives it little) works
ON_END_S = 50.0  # the most `on_end` (a survivor's save) may take: within the batch script's SAVE_GRACE_S (60 s)
BUSY_CAP_S = 600.0  # busy without a step for longer is hung all the same (a GPU wait spins a core: CUDA's default)


def preemptions(task: int | None) -> int | None:
    """How often thread `task` of this process was taken off a core while it ran (Linux's
    nonvoluntary context switches); None where /proc does not say."""
    try:
        for line in Path(f"/proc/self/task/{task}/status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return None


def derived_timeout(step_times: tp.Iterable[float], floor_s: float = FLOOR_S) -> float:
    """`fault.hang_timeout_s: null`: max(FLOOR_S, STEP_FACTOR x the slowest recent step)."""
    return max(floor_s, STEP_FACTOR * max(step_times, default=0.0))


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
        self, run_dir: RunDir, job_id: str, attempt: int, rank: int, world_size: int, timeout_s: float | None,
        pulse: Pulse | None = None, floor_s: float = FLOOR_S, busy_cap_s: float = BUSY_CAP_S,
        on_end: tp.Callable[[], None] | None = None,
    ) -> None:
        """`on_end`: run once it fires, before the exit record (the survivor's save: hpcrun.runtime.context)."""
        self.run_dir, self.job_id, self.attempt, self.rank, self.world_size = run_dir, job_id, attempt, rank, world_size
        self.fixed = timeout_s
        self.timeout_s: float | None = timeout_s
        self.pulse, self.floor_s, self.busy_cap_s, self.on_end = pulse, floor_s, busy_cap_s, on_end
        self.step_times: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.main_thread = threading.main_thread().ident
        self.main_task = threading.main_thread().native_id  # its /proc/self/task entry (`preemptions`)
        self.preempted: int | None = None  # its preemptions at the last look
        self.cpu_at: tuple[float, float] | None = None  # (monotonic, the training thread's CPU seconds)
        self.last = time.monotonic()  # the hang clock's start: the last step's end, or work seen since
        self.stepped = self.last  # the last step's end (monotonic)
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
        if pulse is not None:  # on a thread of its own: a heartbeat write stalled on the filesystem waits here
            pulse.start(self.fire_silent)

    def beat(self, step: int, seconds: float) -> None:
        """Step `step` completed in `seconds`: progress. Two stores on the training thread; the
        heartbeat file is written by the watchdog's own thread."""
        self.last = self.stepped = time.monotonic()
        self.cpu_at = (self.stepped, time.thread_time())  # the training thread's clock, where `working` starts
        self.last_wall = time.time()
        self.step = step
        if self.fixed is None:
            self.step_times.append(seconds)
            self.timeout_s = derived_timeout(self.step_times, self.floor_s)

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
        """End the thread (saying goodbye to the pulse ring); returns the CPU time it used (its cost,
        reported by the loop)."""
        self.done.set()
        self.thread.join(5.0)
        if self.pulse is not None:
            self.pulse.close()
        return self.cpu_s

    def working(self) -> bool:
        """Whether the training thread kept a core busy since the last look: its CPU clock, or, where a
        loaded machine gives it less than BUSY_SHARE of a core, the kernel taking it off a core while it
        ran (a thread asleep in a wait, hung, is never preempted)."""
        if self.main_thread is None:
            return False
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(self.main_thread))
        except (OSError, AttributeError):  # no per-thread clock here: only steps tell
            return False
        now, before = time.monotonic(), self.cpu_at
        self.cpu_at = (now, cpu)
        earlier, self.preempted = self.preempted, preemptions(self.main_task)
        if before is None or now <= before[0]:
            return False
        if (cpu - before[1]) / (now - before[0]) >= BUSY_SHARE:
            return True
        return earlier is not None and self.preempted is not None and self.preempted > earlier

    def _watch(self) -> None:
        while not self.done.wait(1.0):
            try:
                timeout = self.timeout_s
                timed = self.step >= 0 and not self.saves
                busy = timed and self.fixed is None and self.working()
                if busy and time.monotonic() - self.stepped < self.busy_cap_s:
                    self.last = time.monotonic()  # evaluation, compiling: busy on a core is not hung
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
        self.end(f"hung: no step progress for {timeout:.0f} s after step {self.step + 1} "
                 f"(fault.hang_timeout_s{'' if self.fixed else ', derived'}); stacks of every thread of this rank:",
                 failure.HUNG, stacks=True)

    def fire_silent(self, quiet: float) -> tp.NoReturn:
        """The rank before this one in the pulse ring is silent: it stopped, died or lost its node."""
        assert self.pulse is not None
        watched = self.pulse.watched
        self.end(f"{watched} silent for {quiet:.1f} s (fault.peer_timeout_s): ending this attempt",
                 f"{failure.PEER_SILENT}: {watched}", stacks=False, silent=self.pulse.previous)

    def end(self, line: str, error: str, stacks: bool, silent: int | None = None) -> tp.NoReturn:
        """The exit record, the survivor's save (`on_end`), and the end of this process; `silent`: the rank the
        pulse ring found silent, marked last (rundir.named_silent: the batch script ends the step then)."""
        try:
            self.say(line)
            if stacks:
                try:
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                except Exception as exc:  # noqa: BLE001 - no stacks (stderr closed, no file descriptor): still exit
                    self.say(f"stacks not written: {type(exc).__name__}: {exc}")
            # the attempt's one record (hpcrun.runtime.failure) reads why this rank ended and names
            # the silent ranks; no seconds in it, so the same hang at the same step twice is the same failure
            failure.write_exit_record(self.run_dir, self.job_id, self.attempt, self.rank, error, self.step + 1, {},
                                      stepped=self.last_wall if self.step >= 0 else None)
        except Exception as exc:  # noqa: BLE001
            self.say(f"hang not recorded: {type(exc).__name__}: {exc}")
        try:
            if self.on_end is not None:  # after the record, and bounded: a save stuck on the device ends too
                deadline = threading.Timer(ON_END_S, os._exit, args=(EXIT_HUNG,))
                deadline.daemon = True
                deadline.start()
                self.on_end()
        except Exception as exc:  # noqa: BLE001 - the exit still comes
            self.say(f"survivor's save failed: {type(exc).__name__}: {exc}")
        finally:
            if silent is not None:
                try:
                    mark = self.run_dir.named_silent(self.job_id, self.attempt, silent)
                    mark.parent.mkdir(parents=True, exist_ok=True)
                    mark.touch()
                except OSError as exc:
                    self.say(f"silent rank not marked: {exc}")
            os._exit(EXIT_HUNG)  # the stuck main thread never reaches a clean exit
