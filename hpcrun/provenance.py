"""Which code a run ran: the git commit of the recipe's directory, taken once on the login node
when the run is planned (hpcrun.plan), so nothing inside the allocation runs git: not at every
attempt's end, and not in the failure path, where a missing or hung git would hide the failure."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

GIT_TIMEOUT_S = 10.0  # a checkout on a slow shared filesystem answers in well under this


@functools.lru_cache(maxsize=64)
def _git_sha(directory: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", directory, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=GIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"[hpcrun] warning: git rev-parse in {directory} did not answer within {GIT_TIMEOUT_S:.0f} s; "
              "git_sha left empty", file=sys.stderr)
        return None
    except OSError:  # no git on this machine: nothing to record
        return None
    if out.returncode != 0:  # not a checkout
        return None
    return out.stdout.strip() or None


def git_sha(recipe_path: str | Path) -> str | None:
    """The commit checked out where the recipe lives; None when that is not a git checkout, git
    is missing, or it did not answer within GIT_TIMEOUT_S (a warning line). Asked once per
    directory per process: a sweep of a thousand points runs git once."""
    return _git_sha(str(Path(recipe_path).resolve().parent))
