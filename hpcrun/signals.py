"""The process-wide stop flag. USR2 (ahead of the time limit) and SIGTERM (preemption,
scancel) only set it: a collective checkpoint cannot run inside a handler on one rank. The
launcher installs it before anything else, because SLURM may signal as a task starts."""

from __future__ import annotations

import signal
import subprocess
import typing as tp


class SignalFlag:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.child: subprocess.Popen[bytes] | None = None  # a command job's process, which gets it forwarded

    def install(self) -> None:
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: tp.Any) -> None:
        self.signum = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)


FLAG = SignalFlag()
