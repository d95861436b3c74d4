"""SLURM's own count of a user's remote procedure calls, and commands run as the unprivileged
`hpcwatch` user (tests/cluster/testcluster.sh creates it): what the polling test and
benchmarks/campaign_scale.py measure hpcrun's load on the controller with. Counted per user
because root's count includes the daemons' own traffic and every other test's."""

from __future__ import annotations

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
