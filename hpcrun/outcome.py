"""A function job's call outcome, where submitit's Job looks for it: written by the ranks
(hpcrun.runtime.function) and by the failure step for tasks that never got to (hpcrun.runtime.failure).
Apart from hpcrun.executor, which imports the login node's status and submit paths."""

from __future__ import annotations

import typing as tp
from pathlib import Path

from submitit.core.utils import cloudpickle_dump

from hpcrun.recipe import FunctionJob
from hpcrun.rundir import RunDir, atomic_path


def call_folder(job: FunctionJob, run_dir: RunDir) -> Path:
    """Where a call's tasks write their outcomes (submitit's `<job>_<task>_result.pkl`): an
    array's shared log folder, else the run's logs/."""
    return Path(job.folder) if job.folder else run_dir.logs


def write_outcome(path: Path, outcome: tuple[str, tp.Any]) -> None:
    """A task's outcome as submitit's Job reads it: `("success", value)` or `("error", text)`."""
    with atomic_path(path) as tmp:
        cloudpickle_dump(outcome, tmp)
