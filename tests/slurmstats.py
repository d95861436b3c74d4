"""SLURM's own count of a user's remote procedure calls, and commands run as the unprivileged
`hpcwatch` user (tests/cluster/testcluster.sh creates it): what the polling test and
benchmarks/campaign_scale.py measure hpcrun's load on the controller with. Counted per user
because root's count includes the daemons' own traffic and every other test's.

Also SLURM's accounting of a job's steps (`job_steps`): when each began and ended, as slurmctld
saw it, which the cluster tests time the batch script's own work between steps with."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import subprocess
import sys

WATCHER = "hpcwatch"


def rpc_counts(user: str = WATCHER) -> tuple[int, int]:
    """(slurmctld, slurmdbd) remote procedure calls made so far by `user` (`sdiag`, `sacctmgr
    show stats`: "Remote Procedure Call statistics by user")."""

    def by_user(text: str) -> int:
        section = text.split("statistics by user", 1)[-1] if "statistics by user" in text else ""
        found = re.search(rf"^\s*{user}\s+\(\s*\d+\)\s+count:(\d+)", section, re.MULTILINE)
        return int(found[1]) if found else 0

    ctld = subprocess.run(["sdiag"], capture_output=True, text=True, check=True).stdout
    dbd = subprocess.run(["sacctmgr", "show", "stats"], capture_output=True, text=True, check=True).stdout
    return by_user(ctld), by_user(dbd)


def run_as(user: str) -> list[str]:
    """The command prefix running a command as `user`: setpriv execs (no process in between), so
    signals reach the command itself."""
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]


def hpcrun_as(user: str = WATCHER) -> list[str]:
    return [*run_as(user), sys.executable, "-m", "hpcrun.cli"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of one start of a job, as sacct -D lists it (times in whole seconds)."""

    start: int  # which start of the job (0: the first; a requeue adds one)
    id: str  # "batch", "extern", or the step's number
    state: str
    exit_code: str
    tasks: int
    began: dt.datetime | None
    ended: dt.datetime | None  # None while it runs


def _when(text: str) -> dt.datetime | None:
    return dt.datetime.fromisoformat(text) if text[:1].isdigit() else None


def job_steps(job: str) -> list[Step]:
    """Every step of every start of `job` (the job's own records left out), in sacct's order: each
    start's steps after its record, the batch step first, then by number."""
    out = subprocess.run(["sacct", "-D", "-n", "-P", "-j", job, "-o", "JobID,State,ExitCode,Start,End,NTasks"],
                         capture_output=True, text=True, check=True).stdout
    steps: list[Step] = []
    start = -1
    for line in out.splitlines():
        name, state, code, began, ended, tasks = line.split("|")
        if name == job:
            start += 1
        elif name.startswith(f"{job}."):
            steps.append(Step(start, name.split(".", 1)[1], state.split()[0] if state else "", code,
                              int(tasks) if tasks.isdigit() else 0, _when(began), _when(ended)))
    return steps


def numbered_steps(job: str) -> list[Step]:
    """The numbered steps of a job that SLURM started once, by number, each once: a node dropped from
    the running job (RESIZING) closes its record and opens another, which `job_steps` counts as a
    start, and a step running across the resize may be listed under both (the first with the resize
    as its end): the later end is kept."""
    found: dict[str, Step] = {}
    for step in job_steps(job):
        seen = found.get(step.id)
        if step.id.isdigit() and (seen is None or (step.ended or dt.datetime.max) > (seen.ended or dt.datetime.max)):
            found[step.id] = step
    return sorted(found.values(), key=lambda s: int(s.id))
