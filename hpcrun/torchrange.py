"""The torch releases hpcrun supports, stated once: setup.cfg's requirement agrees with it (a test
reads both), a rank refuses a torch below it at start-up (hpcrun.launch), and `hpcrun doctor`
says where the ranks' torch stands. Pure: it imports no torch, so the login node reads it too.

- Below OLDEST: refused, one line, before anything else runs. hpcrun saves the training state
  through torch.distributed.checkpoint's staging and state-dict APIs, which older releases lack
  or run differently; a run there would not fail at start but hours in, at a save (2.11's
  DefaultStager failed at a run's second save until hpcrun staged differently there).
- OLDEST to NEWEST_TESTED: supported; CI runs the checkpoint, snapshot and exact-resume tests on
  both ends.
- Above NEWEST_TESTED: warned, not refused. A GPU cluster installs its own torch, often newer than
  any release hpcrun was tested on, and the user cannot downgrade it; torch keeps DCP's public API
  across releases, so a newer one most likely works, and the warning names what is untested.
  setup.cfg therefore has no upper bound either.
"""

from __future__ import annotations

import dataclasses
import re

OLDEST = (2, 11)
NEWEST_TESTED = (2, 13)
REQUIREMENT = f"torch>={OLDEST[0]}.{OLDEST[1]}"  # what setup.cfg's extras ask for
REFUSED_PREFIX = "hpcrun: unsupported torch"  # how a refused rank's line starts (hpcrun doctor finds it)

OK, NEWER, REFUSED = "ok", "newer", "refused"


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string: "2.11.0+cu130", "2.14.0a0+git1234" and
    "2.14.0.dev20261101+cpu" all name their release; None when it names none."""
    found = re.match(r"\s*(\d+)\.(\d+)(?:\D|$)", version)
    return (int(found[1]), int(found[2])) if found else None


def _name(release_: tuple[int, int]) -> str:
    return f"{release_[0]}.{release_[1]}"


SUPPORTED = f"{_name(OLDEST)} to {_name(NEWEST_TESTED)}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    status: str  # ok | newer | refused
    message: str  # one line naming the version found and the supported range


def refused_version(line: str) -> str | None:
    """The torch version a refused rank's line (`verdict(...).message`) names; None for any other line."""
    if not line.startswith(REFUSED_PREFIX + " "):
        return None
    rest = line[len(REFUSED_PREFIX) + 1 :]
    return rest[: rest.find(": ")] if ": " in rest else None


def verdict(version: str) -> Verdict:
    """Where torch `version` (torch.__version__) stands against the supported range."""
    found = release(version)
    if found is None:  # nothing to compare: a release hpcrun cannot name is not one it supports
        return Verdict(
            REFUSED, f"{REFUSED_PREFIX} {version}: not a version hpcrun can read (it supports {SUPPORTED})"
        )
    if found < OLDEST:
        return Verdict(
            REFUSED,
            f"{REFUSED_PREFIX} {version}: hpcrun supports torch {SUPPORTED}; "
            f"install {REQUIREMENT} in the job's environment (the site's environment.setup or python)",
        )
    if found > NEWEST_TESTED:
        return Verdict(
            NEWER,
            f"torch {version} is newer than hpcrun was tested on ({SUPPORTED}): it runs, "
            "but its checkpoints and snapshots are untested there",
        )
    return Verdict(OK, f"torch {version} is supported ({SUPPORTED})")
