"""Heartbeats: each rank's watchdog says, every few seconds, that its process still runs and
which step it last completed (`heartbeats/<job>-<attempt>-rank<N>.json`). A SIGSTOPped or dead
rank's file goes stale; a rank waiting in a collective keeps its own fresh.

Who reads them: only the one writer of a hung attempt's record (hpcrun.runtime.failure), once,
after the job step ended: every rank's file once, O(ranks) metadata operations per hang. The
ranks whose watchdog fires read none (each reading all would be O(ranks^2) on the shared
filesystem's metadata server, at the moment the whole job hangs).

Imports no torch: the failure step runs after srun, outside the ranks.
"""

from __future__ import annotations

import json
import os
import time
import typing as tp

from hpcrun import slurm
from hpcrun.rundir import RunDir, replace_whole

HEARTBEAT_S = 5.0  # at most one heartbeat write per rank this often (shared filesystems) ...
HEARTBEATS_PER_S = 200.0  # ... and at most this many per second from the whole job: 40 s apart at 8,000 ranks
STALE = 3  # a heartbeat older than this many intervals: the process stopped running


def interval(world_size: int) -> float:
    """Seconds between one rank's heartbeats: HEARTBEAT_S, longer for large jobs, so the shared
    filesystem's metadata server sees at most HEARTBEATS_PER_S writes from the job."""
    return max(HEARTBEAT_S, world_size / HEARTBEATS_PER_S)


def write(run_dir: RunDir, job_id: str, attempt: int, rank: int, step: int, stepped: float,
          before: float | None = None) -> float:
    """This rank's last step (`stepped`: when, unix time) and that this process still runs, with
    when it last said so (`before`). Returns the time it says it ran (the next `before`)."""
    path = run_dir.heartbeat(job_id, attempt, rank)
    path.parent.mkdir(exist_ok=True)
    alive = time.time()
    beat = {"rank": rank, "host": slurm.node_name(os.environ), "step": step, "stepped": stepped, "alive": alive,
            "before": before}
    replace_whole(path, json.dumps(beat))  # a heartbeat lost to a crash says what a stale one says
    return alive


def silent(run_dir: RunDir, job_id: str, attempt: int, world_size: int, at: float,
           skip: int | None = None) -> list[str]:
    """The ranks of an attempt whose process had stopped running at unix time `at` (no heartbeat
    for STALE intervals: SIGSTOPped, dead, or its node gone), each as "rank N on HOST (...)"
    with its last step; `skip` (the rank that saw the hang) is not asked about. A heartbeat that
    is not one (foreign, torn) is named with its file, never taken as fresh."""
    stale_s = STALE * interval(world_size)
    found = []
    for rank in range(world_size):
        if rank == skip:
            continue
        path = run_dir.heartbeat(job_id, attempt, rank)
        try:
            beat = json.loads(path.read_text())
            alive, host, step = float(beat["alive"]), str(beat["host"]), int(beat["step"])
        except FileNotFoundError:
            found.append(f"rank {rank} (no heartbeat)")
            continue
        except (OSError, ValueError, TypeError, KeyError) as exc:
            found.append(f"rank {rank} (heartbeat unreadable: {path}: {type(exc).__name__})")
            continue
        if alive > at and isinstance(beat.get("before"), (int, float)):
            # written after the hang was declared: a stopped process that SLURM's end of the step
            # let run again (SIGCONT comes before SIGKILL); its previous beat says when it last ran
            alive = float(beat["before"])
        if at - alive > stale_s:
            found.append(f"rank {rank} on {host} (not running for {at - alive:.0f} s; last step {step + 1})")
    return found


def short(described: tp.Iterable[str]) -> str:
    """"rank 3 on node2, rank 5": what `silent` found, without the seconds, so the same hang at
    the same step twice reads the same."""
    return ", ".join(s.split(" (")[0] for s in described)
