"""A warm standby (`fault.warm_standby`): the next attempt's ranks, started by the batch script beside
the running attempt's on the same nodes, waiting for a line on their stdin (srun gives every task the
same lines):

- `warm` once the running attempt trains: Python, torch and hpcrun's runtime are imported then, off
  the critical path of a restart (~2.5 s of a core per rank here; more from a loaded shared file system);
- `go`: a dead or hung rank failed the attempt and the failure step restarts it on the same nodes: the
  standby is that restart. Its environment (HPCRUN_ATTEMPT, MASTER_PORT, ...) was the next attempt's
  from its start, so it runs on as a rank started then would;
- `exit`: it was not needed (status 0); end of input (the batch script or srun gone) or a stop signal:
  neither (status UNTOLD).

Imports no torch until told `warm` (or `go`): a standby costs an idle interpreter until the attempt
beside it has started, and the import competes with nothing then.
"""

from __future__ import annotations

import os
import select
import sys
import time
import typing as tp

from hpcrun.signals import SignalFlag
from hpcrun.slurm import STANDBY_ENV as ENV
from hpcrun.slurm import STANDBY_EXIT as EXIT
from hpcrun.slurm import STANDBY_GO as GO
from hpcrun.slurm import STANDBY_WARM as WARM

__all__ = ["ENV", "EXIT", "GO", "WARM", "release", "wait", "warm_up"]
POLL_S = 1.0  # how often a waiting standby looks at its stop flag


def warm_up() -> float:
    """Import what a rank imports before it trains; returns the seconds it took."""
    began = time.perf_counter()
    import torch  # noqa: F401

    import hpcrun.runtime.trainer  # noqa: F401  (the runtime, the strategies, the model)

    return time.perf_counter() - began


UNTOLD = 3
"""A standby's exit status when it leaves untold (end of input, a stop signal): were it taken for the
restart meanwhile, the step fails rather than passing for a completed training."""


def wait(flag: SignalFlag, fd: int = 0, warm: tp.Callable[[], float] = warm_up) -> int | None:
    """Wait for the batch script's word on `fd`: None when told `go` (warmed by then), else the exit
    status to leave with: 0 for `exit`, UNTOLD at the end of input or on a stop signal. Reads the
    descriptor itself, not through a buffered stream, so that two lines sent together are both seen."""
    pending, warmed = b"", False
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if flag.signum is not None:  # the job is stopping or requeueing: no restart will come
            return UNTOLD
        if not ready:
            continue
        data = os.read(fd, 4096)
        if not data:
            return UNTOLD
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            word = line.decode(errors="replace").strip()
            if word in (WARM, GO) and not warmed:
                took, warmed = warm(), True
                print(f"[hpcrun] standby: warm in {took:.1f} s", file=sys.stderr, flush=True)
            if word == GO:
                release(fd)
                return None
            if word == EXIT:
                return 0


def release(fd: int) -> None:
    """Let go of the batch script's pipe: a rank reads nothing on stdin."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, fd)
    os.close(null)
