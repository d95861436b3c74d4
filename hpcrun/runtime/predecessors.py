"""An earlier attempt's processes still on this node: a restart inside the job waits for them.

After a failed step the batch script starts the next one at once (`srun --overlap`), and after
its grace kill (a lost node's step) nothing waits for the killed ranks at all. A rank holding
tens of GB of pinned host and GPU memory can take seconds to exit, and a new rank starting
beside it would fail with out-of-memory at set-up. So each rank of a restart, before it touches
a device, waits until no process of an earlier attempt of its job runs on its node: one whose
environment has this job's SLURM_JOB_ID and an earlier HPCRUN_ATTEMPT (the batch script's count),
the ranks and whatever they started (data-loader and compile workers) alike. /proc shows the
node's processes (a container's, where the ranks run in one: their predecessors ran in one too).
The wait is bounded (WAIT_S, then a line on stderr and the start goes on) and measured: the
results row's `restart_wait_s`.

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


def wait_gone(job_id: str, attempt: int, timeout: float = WAIT_S) -> float:
    """Seconds waited until no process of an earlier attempt of `job_id` runs here (at most
    `timeout`; then a line on stderr)."""
    start = time.monotonic()
    left = earlier(job_id, attempt)
    if left:
        print(f"[hpcrun] waiting for earlier attempts' processes on this node to exit: pids "
              f"{', '.join(map(str, left[:8]))}", file=sys.stderr, flush=True)
    while left and time.monotonic() - start < timeout:
        time.sleep(POLL_S)
        left = earlier(job_id, attempt)
    waited = time.monotonic() - start
    if left:
        print(f"[hpcrun] starting beside attempt < {attempt}'s processes still here after {waited:.0f} s: "
              f"pids {', '.join(map(str, left[:8]))}", file=sys.stderr, flush=True)
    return waited
