"""The in-job entry point: one rank of one run attempt, from the path of its runspec.json.

The training loop is hpcrun.runtime.context (the Context every job is written against) and
hpcrun.runtime.jobs (what each kind of job does with it); the attempt around it, from start to
the results row and requeue, is hpcrun.runtime.attempt.
"""

from __future__ import annotations

import typing as tp
from pathlib import Path

import pydantic

from hpcrun.errors import HpcrunError
from hpcrun.plan import RunSpec
from hpcrun.rundir import CorruptStateError, read_json
from hpcrun.runtime.attempt import run
from hpcrun.runtime.context import Context

__all__ = ["Context", "main"]


def main(spec_path: str) -> dict[str, tp.Any]:
    """Run the attempt `spec_path` (a run directory's runspec.json) describes. Returns this
    rank's summary; raises when the job failed."""
    path = Path(spec_path)
    data = read_json(path, missing=None)
    if data is None:
        raise HpcrunError("no such run spec", path)
    try:
        spec = RunSpec.model_validate(data)
    except pydantic.ValidationError as exc:  # never guessed at: it says what this job must run
        raise CorruptStateError(path, f"not a run spec: {str(exc).splitlines()[0]}") from exc
    return run(spec)
