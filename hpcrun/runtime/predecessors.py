"""An earlier attempt's processes still on this node: a restart inside the job waits for them.

After a failed step the batch script starts the next one at once (`srun --overlap`), and after
its grace kill (a lost node's step) nothing waits for the killed ranks at all. A rank holding
tens of GB of pinned host and GPU memory can take seconds to exit, and a new rank starting
beside it would fail with out-of-memory at set-up. So each rank of a restart, before it touches
a device, waits until no process of an earlier attempt of its job runs on its node: one whose
environment has this job's SLURM_JOB_ID and an earlier HPCRUN_ATTEMPT (the batch script's count),
the ranks and whatever they started (data-loader and compile workers) alike. /proc shows the
node's processes.
A process is followed by its pid once found: one whose exit has begun shows no environment while
it still frees its memory. The wait is bounded (WAIT_S, then a line on stderr and the start goes
on) and measured: the results row's `restart_wait_s`. /proc must show the old ranks: a container
that runs the ranks in a pid namespace of their own per step hides them (no wait).

Imports no torch: it runs before the rank touches a device.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

WAIT_S = 120.0  # longer than any exit seen, shorter than a restart that would fail anyway
POLL_S = 0.1


def earlier(job_id: str, attempt: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids on this node of job `job_id`'s attempts before `attempt`."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "environ").read_bytes()  # empty for a zombie, which holds no memory
        except OSError:  # gone, or another user's
            continue
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        theirs = env.get(b"HPCRUN_ATTEMPT", b"")
        if env.get(b"SLURM_JOB_ID") == job_id.encode() and theirs.isdigit() and int(theirs) < attempt:
            found.append(int(entry.name))
    return found


def running(pid: int, proc: Path = Path("/proc")) -> bool:
    """Not yet a zombie: a process whose exit has begun can no longer show its environment, but
    frees its memory (host pages, then its device files) only on the way to being one."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def wait_gone(job_id: str, attempt: int, timeout: float = WAIT_S) -> float:
    """Seconds waited until no process of an earlier attempt of `job_id` runs here (at most
    `timeout`; then a line on stderr): those found by their environment, followed by pid."""
    start = time.monotonic()
    left = set(earlier(job_id, attempt))
    if left:
        print(f"[hpcrun] waiting for earlier attempts' processes on this node to exit: pids "
              f"{', '.join(map(str, sorted(left)[:8]))}", file=sys.stderr, flush=True)
    while left and time.monotonic() - start < timeout:
        time.sleep(POLL_S)
        left = {pid for pid in left if running(pid)} | set(earlier(job_id, attempt))
    waited = time.monotonic() - start
    if left:
        print(f"[hpcrun] starting beside attempt < {attempt}'s processes still here after {waited:.0f} s: "
              f"pids {', '.join(map(str, sorted(left)[:8]))}", file=sys.stderr, flush=True)
    return waited
