"""A rank's log of a run's latest job: where it is, and reading it while the job writes it."""

from __future__ import annotations

import codecs
import time
import typing as tp
from pathlib import Path

from hpcrun.backend import load_spec
from hpcrun.errors import HpcrunError
from hpcrun.rundir import RunDir
from hpcrun.status import statuses


def log_path(run_dir: Path, rank: int, stream: str = "out") -> Path:
    """A rank's log of the run's latest job (an array's logs sit in the sweep's log folder): one
    per task, so a rank the run does not have is refused, naming the ones it has."""
    job = RunDir(run_dir).latest_job()
    if job is None:
        raise HpcrunError("no job was submitted for this run (a dry run?), so it has no logs", run_dir)
    spec = load_spec(run_dir)
    tasks = spec.nodes * spec.tasks_per_node  # torchrun: one task (and log) per node, whose ranks write into it
    if not 0 <= rank < tasks:
        what = "ranks" if spec.tasks_per_node == spec.ranks_per_node else "tasks (one per node: torchrun)"
        raise HpcrunError(f"the run has {what} 0-{tasks - 1}, so no log for --rank {rank}", run_dir, "--rank")
    return RunDir(run_dir).log(job["job_id"], rank, stream, job.get("log_folder"))


def read(run_dir: Path, rank: int, follow: bool, poll_s: float = 1.0) -> tp.Iterator[str]:
    """The log's text as it grows; with `follow`, until the job has ended. Once the job has
    ended, the next read is the last and gets every line."""
    path = log_path(run_dir, rank)
    offset, text = 0, codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        # ask before reading: once the job has ended, this read is the last and gets every line
        ended = not follow or statuses([run_dir])[0].done
        if path.exists():
            with path.open("rb") as f:  # bytes, decoded across reads: a read may end inside a character
                f.seek(offset)
                chunk = f.read()
                offset += len(chunk)
            yield text.decode(chunk, final=ended)
        if ended:
            return
        time.sleep(poll_s)
