"""Submission: write a run directory and hand its rendered script to the scheduler, SLURM's
`sbatch` or the local controller. The script submitted is the file `render` printed, byte for
byte; the job's tasks start `python -m hpcrun.launch <run dir>`, which reads the RunSpec.

submitit is used where it has a public interface: inside the job, `submitit.JobEnvironment`
tells each task its ranks (runtime/env.py). Submission is hpcrun's own because submitit has no
public hook for the text of the sbatch script (only private executor methods), and hpcrun's
promise is that the rendered template is what runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcrun import localjob, slurm
from hpcrun.errors import HpcrunError, SubmissionError
from hpcrun.plan import RunSpec
from hpcrun.render import render, render_array
from hpcrun.rundir import CorruptStateError, RunDir, atomic_write


def prepare(spec: RunSpec, script: str | None = None) -> Path:
    """Write the run directory: the resolved RunSpec and the script (an array's script for a
    sweep point). Returns its path. A run directory whose job record is corrupt is refused
    before anything in it is overwritten."""
    run_dir = RunDir(spec.run_dir)
    run_dir.jobs()  # raises CorruptStateError: never overwrite what we cannot read
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir.spec, spec.model_dump_json(indent=1))
    atomic_write(run_dir.script, script if script is not None else render(spec))
    return run_dir.path


def require_sbatch(spec: RunSpec) -> None:
    slurm.require("sbatch", f"site {spec.site.name!r} needs a SLURM login node")


def submit(spec: RunSpec, dependency: str | None = None) -> str:
    """Submit a prepared run; returns the job id. A refused submission leaves no run directory
    that looks live: a fresh one is removed, and the scheduler's own message is raised."""
    run_dir = RunDir(spec.run_dir)
    earlier = run_dir.jobs()
    try:
        if spec.site.scheduler == "local":
            # locally each submission of the run is one restart (SLURM counts its own)
            job_id = localjob.start(run_dir, spec.tasks_per_node, spec.time_min, spec.signal_lead_s, restart_count=len(earlier))
        else:
            require_sbatch(spec)
            job_id = slurm.sbatch(run_dir.script, dependency)
    except SubmissionError:
        if not earlier:
            shutil.rmtree(run_dir.path, ignore_errors=True)
        raise
    run_dir.record_job(job_id, spec.site.scheduler)
    return job_id


def submit_array(specs: list[RunSpec], log_folder: Path, max_concurrent: int | None) -> list[str]:
    """Points that render to the same script as one job array (task `i` runs `specs[i]`);
    returns their job ids (`<array>_<index>`). A refused array leaves none of its fresh run
    directories behind."""
    require_sbatch(specs[0])
    array = f"0-{len(specs) - 1}" + (f"%{max_concurrent}" if max_concurrent else "")
    script = render_array(specs, array, log_folder)
    earlier = [bool(RunDir(spec.run_dir).jobs()) for spec in specs]
    run_dirs = [prepare(spec, script) for spec in specs]
    log_folder.mkdir(parents=True, exist_ok=True)
    try:
        array_id = slurm.sbatch(RunDir(run_dirs[0]).script)
    except SubmissionError:
        for run_dir, retried in zip(run_dirs, earlier):
            if not retried:  # a retried point keeps its history and checkpoints
                shutil.rmtree(run_dir, ignore_errors=True)
        raise
    jobs = [f"{array_id}_{index}" for index in range(len(specs))]
    for run_dir, job in zip(run_dirs, jobs):
        RunDir(run_dir).record_job(job, "slurm", log_folder=str(log_folder))
    return jobs


def load_spec(run_dir: Path) -> RunSpec:
    """The RunSpec a run was submitted with; a missing or unreadable one is one line."""
    path = RunDir(run_dir).spec
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise HpcrunError(f"not a run directory (no {path.name})", run_dir) from exc
    except OSError as exc:
        raise CorruptStateError(path, f"unreadable: {exc}") from exc
    try:
        return RunSpec.model_validate_json(text)
    except ValueError as exc:
        raise CorruptStateError(path, str(exc).splitlines()[0]) from exc
