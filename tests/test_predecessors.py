"""A restart's wait for an earlier attempt's processes on its node (hpcrun.runtime.predecessors),
with real processes standing in: one of this job's attempt 0 that takes 2 s to exit, and others
the wait must not count (this attempt's own, another job's)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from hpcrun.runtime import predecessors


def process(job: str, attempt: int, seconds: float) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SLURM_JOB_ID": job, "HPCRUN_ATTEMPT": str(attempt)}
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], env=env)


def test_a_restart_waits_for_the_earlier_attempt_only() -> None:
    job = f"9{uuid.uuid4().int % 10**8}"  # no other test's
    old, same, other = process(job, 0, 2), process(job, 1, 30), process(f"{job}1", 0, 30)
    try:
        time.sleep(0.3)  # exec'd, with their environments
        assert predecessors.earlier(job, 1) == [old.pid]
        waited = predecessors.wait_gone(job, 1)
        assert old.poll() is not None and 1.0 <= waited < 10, waited
        assert predecessors.earlier(job, 1) == [] and predecessors.wait_gone(job, 1) < 0.5
    finally:
        for p in (old, same, other):
            p.kill()
            p.wait()
