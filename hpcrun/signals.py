"""The process-wide stop flag. USR2 (ahead of the time limit) and SIGTERM (preemption,
scancel) only set it: a collective checkpoint cannot run inside a handler on one rank. The
launcher installs it before anything else, because SLURM may signal as a task starts.

A Python handler runs only when the main thread next runs Python code. A rank blocked in a
collective whose peer died (gloo and NCCL wait in C++) never does, so it would live on until
SLURM's SIGKILL, KillWait later. That wait is not harmless: slurmd answers slurmctld's "end this
step" only once every task is gone, and a request not answered within MessageTimeout (10 s by
default, KillWait is 30 s) is sent again about 60 s later; by then the job may have been
requeued and started again, and the late request ends the new attempt's step of the same id
(seen on the test cluster as a requeue loop). So a watcher thread learns of SIGTERM from the
interpreter's wakeup fd (written by the C-level handler, whatever the main thread does) and,
when the Python handler has not run within STUCK_S, writes every thread's stack to the log and
ends the process as SIGTERM would have.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
import typing as tp

STUCK_S = 5.0  # well under SLURM's default MessageTimeout (10 s)


class SignalFlag:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # when the first stop signal came (epoch seconds): a timeout or not
        self.child: subprocess.Popen[bytes] | None = None  # a command job's process, which gets it forwarded
        self.forwarded = False
        self.terms_handled = 0  # SIGTERMs the Python handler has seen (the watcher compares)
        self.installed = False
        # called from the handler after the flag is set: a function job (hpcrun.runtime.function)
        # raises here to leave a call that never looks at the flag
        self.interrupt: tp.Callable[[int], None] | None = None

    def install(self) -> None:
        """Idempotent: the launcher installs it first thing, the attempt again in case the
        task was started some other way."""
        if self.installed:
            return
        self.installed = True
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._handle)
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), name="hpcrun-sigterm-watch", daemon=True).start()

    def _handle(self, signum: int, frame: tp.Any) -> None:
        self.signum = signum
        self.at = self.at or time.time()
        if signum == signal.SIGTERM:
            self.terms_handled += 1
        self.forward()
        if self.interrupt is not None:
            self.interrupt(signum)

    def forward(self) -> None:
        """Tell a command job's process to stop: once, as SIGTERM, what launchers and frameworks
        take as "save and exit" (hpcrun.runtime.command); under SLURM it also gets SLURM's own."""
        if self.child is not None and not self.forwarded and self.child.poll() is None:
            self.forwarded = True
            self.child.send_signal(signal.SIGTERM)

    def _watch(self, read: int) -> None:
        seen = 0
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                return
            terms = data.count(bytes([signal.SIGTERM]))
            if not terms:
                continue
            seen += terms
            deadline = time.monotonic() + STUCK_S
            while self.terms_handled < seen and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.terms_handled < seen:
                self._end_stuck()

    def _end_stuck(self) -> None:
        sys.stderr.write(f"[hpcrun] SIGTERM: the main thread did not return to Python within {STUCK_S:.0f} s "
                         "(blocked in native code, e.g. a collective whose peer is gone); ending now. Its stacks:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)


FLAG = SignalFlag()
