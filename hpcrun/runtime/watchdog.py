"""The hang watchdog: a daemon thread per rank that ends the attempt when the rank made no step
progress for `fault.hang_timeout_s`.

It depends on nothing the stuck thread holds: it reads two numbers the loop writes after every
step, and on firing it writes every thread's Python stack to this rank's log (faulthandler, which
needs no GIL-holding cooperation from the stuck thread), names the ranks whose heartbeats went
silent, and ends the process with EXIT_HUNG. A non-zero exit ends the job step (srun's
--kill-on-bad-exit), and the attempt is recorded and requeued like any failed one. A rank that is
stopped (SIGSTOP) cannot dump its own stack; its peers, waiting for it in a collective, fire
instead and name it from its stale heartbeat file.

Only steps are timed. The first step (compilation, the first collectives' setup) and checkpoint
saves may take far longer than a step without being hung, so neither counts against the timeout:
the clock starts at the first step's end and restarts when a save ends. A collective that never
completes in either is still ended by the process group's timeout (fault.collective_timeout_s).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
import typing as tp
from pathlib import Path

from hpcrun.rundir import RunDir, replace_whole
from hpcrun.runtime import failure

EXIT_HUNG = 75
FLOOR_S = 300.0  # the derived timeout's floor: slower saves and evaluation steps are not hangs
STEP_FACTOR = 20  # the derived timeout: this many median step times (of the first MEASURED steps)
MEASURED = 5
HEARTBEAT_S = 5.0  # at most one heartbeat write per rank this often (shared filesystems) ...
HEARTBEATS_PER_S = 200.0  # ... and at most this many per second from the whole job: 40 s apart at 8,000 ranks


def heartbeat_interval(world_size: int) -> float:
    """Seconds between one rank's heartbeats: HEARTBEAT_S, longer for large jobs, so the shared
    filesystem's metadata server sees at most HEARTBEATS_PER_S writes from the job."""
    return max(HEARTBEAT_S, world_size / HEARTBEATS_PER_S)


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

    def __init__(self, run_dir: RunDir, job_id: str, restart: int, rank: int, world_size: int, timeout_s: float | None) -> None:
        self.run_dir, self.job_id, self.restart, self.rank, self.world_size = run_dir, job_id, restart, rank, world_size
        self.fixed = timeout_s
        self.timeout_s: float | None = timeout_s
        self.step_times: list[float] = []
        self.last = time.monotonic()
        self.last_wall = time.time()
        self.step = -1  # no step completed yet: not timed (see the module's docstring)
        self.saves = 0  # saves in progress: not timed
        self.written = 0.0
        self.interval = heartbeat_interval(world_size)
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
            timeout = self.timeout_s
            timed = self.step >= 0 and not self.saves
            if timeout is not None and timed and time.monotonic() - self.last > timeout:
                self.fire(timeout)
            if time.monotonic() - self.written >= self.interval:
                self.heartbeat()
        self.cpu_s = time.thread_time()

    def heartbeat(self) -> None:
        """This rank's last step and that this process still runs (`alive`): a stopped or dead
        rank's file goes stale, a rank waiting in a collective keeps it fresh."""
        self.written = time.monotonic()
        path = self.run_dir.heartbeat(self.job_id, self.restart, self.rank)
        path.parent.mkdir(exist_ok=True)
        beat = {"rank": self.rank, "host": socket.gethostname(), "step": self.step, "stepped": self.last_wall, "alive": time.time()}
        replace_whole(path, json.dumps(beat))  # a heartbeat lost to a crash says what a stale one says

    def fire(self, timeout: float) -> None:
        """Stacks, the silent ranks, and the end of this process (see the module's docstring)."""
        err = sys.stderr
        err.write(f"[hpcrun rank {self.rank}] hung: no step progress for {timeout:.0f} s after step {self.step + 1} "
                  f"(fault.hang_timeout_s{'' if self.fixed else ', derived'}); stacks of every thread of this rank:\n")
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)
        silent = self.silent_ranks(timeout)
        if silent:
            err.write(f"[hpcrun rank {self.rank}] silent ranks: {'; '.join(silent)}\n")
        err.flush()
        # the attempt's one record (hpcrun.runtime.failure) reads why this rank ended; no
        # seconds in it, so the same hang at the same step twice is recognised as the same failure
        who = "; silent: " + ", ".join(s.split(" (")[0] for s in silent) if silent else ""
        failure.write_exit_record(self.run_dir, self.job_id, self.restart, self.rank, f"hung (no step progress for fault.hang_timeout_s){who}", self.step + 1, {})
        os._exit(EXIT_HUNG)  # the stuck main thread never reaches a clean exit

    def silent_ranks(self, timeout: float) -> list[str]:
        """The other ranks of this attempt whose process has stopped running (no heartbeat for
        3 heartbeat intervals: SIGSTOPped, dead, or its node gone), with their host and last step."""
        now, found = time.time(), []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            path: Path = self.run_dir.heartbeat(self.job_id, self.restart, rank)
            try:
                beat = json.loads(path.read_text())
            except (OSError, ValueError):
                found.append(f"rank {rank} (no heartbeat)")
                continue
            if now - float(beat["alive"]) > 3 * self.interval:
                found.append(f"rank {rank} on {beat['host']} (not running for {now - float(beat['alive']):.0f} s; last step {int(beat['step']) + 1})")
        return found
