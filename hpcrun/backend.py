"""The submitit seam: executors whose submitted script is the rendered template, and the
scheduler queries behind `status`, `logs` and `cancel`. The only module with side effects on
the cluster."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import unittest.mock
import uuid
import typing as tp
from pathlib import Path

import submitit
import submitit.local.local
from submitit.core.utils import JobPaths
from submitit.slurm.slurm import SlurmJob
from submitit.core.utils import FailedJobError

from hpcrun.errors import HpcrunError, SubmissionError
from hpcrun.plan import RunSpec
from hpcrun.render import python_command, render, task_command
from hpcrun.task import run as task_run

SPEC_FILE = "runspec.json"
SCRIPT_FILE = "script.sh"
JOBS_FILE = "jobs.json"
STATE_FILE = "state.json"


class RenderedSlurmExecutor(submitit.SlurmExecutor):
    """submitit's SLURM executor, except that the sbatch file is hpcrun's rendered template
    (its documented `_make_submission_file_text` hook), so `render` output is what runs."""

    def __init__(self, spec: RunSpec, script: str, dependency: str | None = None, folder: Path | None = None) -> None:
        super().__init__(folder=folder or spec.log_folder, python=python_command(spec))
        self.spec = spec
        self.script = script
        self.dependency = dependency
        # only what submitit itself reads back: the task count and the timeout bookkeeping
        self.update_parameters(nodes=spec.nodes, ntasks_per_node=spec.ranks_per_node, time=spec.time_min)

    @property
    def _submitit_command_str(self) -> str:
        return task_command(self.spec, self.folder)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        if command not in self.script:  # the template's launch line must be the one submitit runs
            raise RuntimeError(f"task command {command!r} is not in the rendered script")
        return self.script

    def _internal_process_submissions(self, delayed_submissions: list[tp.Any]) -> list[tp.Any]:
        """Several submissions are one job array whose script is ours (submitit's own array
        path would build a plain executor and its own sbatch text). Array task `a` runs the
        a-th pickle, as in submitit."""
        if len(delayed_submissions) == 1:
            return super()._internal_process_submissions(delayed_submissions)
        folder = JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickles = []
        for delayed in delayed_submissions:
            path = folder / f"{uuid.uuid4().hex}.pkl"
            delayed.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
            delayed.dump(path)
            pickles.append(path)
        first = self._submit_command(self._submitit_command_str)
        jobs = [SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{a}", tasks=list(range(first.num_tasks))) for a in range(len(pickles))]
        for job, path in zip(jobs, pickles):
            job.paths.move_temporary_file(path, "submitted_pickle")
        return jobs

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        deps = [f"--dependency={self.dependency}"] if self.dependency else []
        return ["sbatch", "--parsable", *deps, str(submission_file_path)]

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        return text.strip().splitlines()[-1].split(";")[0]


class RenderedLocalExecutor(submitit.LocalExecutor):
    """submitit's local executor running the rendered local script once per rank."""

    def __init__(self, spec: RunSpec, script_path: Path) -> None:
        super().__init__(folder=spec.log_folder, python=python_command(spec))
        self.script_path = script_path
        self.update_parameters(tasks_per_node=spec.ranks_per_node, timeout_min=spec.time_min, signal_delay_s=spec.signal_lead_s)

    @property
    def _submitit_command_str(self) -> str:
        return f"bash {shlex.quote(str(self.script_path))}"

    def _submit_command(self, command: str) -> tp.Any:
        """Start the controller detached, like a batch job: in its own session, so a Ctrl-C at
        `hpcrun submit --wait` does not reach the ranks, and with its own log instead of our
        stdout/stderr, which would keep a caller's pipe (`| tee`, a test) open until the job
        ends. submitit's start_controller offers neither, hence the two patches around it."""
        log = os.open(self.script_path.parent / "logs" / "controller.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.dup2(log, 1)
            os.dup2(log, 2)
            detached = functools.partial(subprocess.Popen, start_new_session=True)
            with unittest.mock.patch.object(submitit.local.local.subprocess, "Popen", detached):
                return super()._submit_command(command)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (log, *saved):
                os.close(fd)


def prepare(spec: RunSpec, script: str | None = None) -> Path:
    """Write the run directory: the resolved RunSpec and the script (an array's shared script
    for a sweep point). Returns its path."""
    run_dir = Path(spec.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / SPEC_FILE).write_text(spec.model_dump_json(indent=1))
    (run_dir / SCRIPT_FILE).write_text(script if script is not None else render(spec))
    return run_dir


def require_sbatch(spec: RunSpec) -> None:
    if shutil.which("sbatch") is None:
        raise SubmissionError(f"sbatch is not on PATH: site {spec.site.name!r} needs a SLURM login node")


def submit(spec: RunSpec, dependency: str | None = None) -> str:
    """Submit a prepared run; returns the job id. A refused submission leaves no run directory
    that looks live: it is removed, and the scheduler's own message is raised."""
    run_dir = Path(spec.run_dir)
    fresh = not (run_dir / JOBS_FILE).exists()
    script = (run_dir / SCRIPT_FILE).read_text()
    try:
        if spec.site.scheduler == "local":
            executor: submitit.Executor = RenderedLocalExecutor(spec, run_dir / SCRIPT_FILE)
            # SLURM counts restarts itself; locally each resubmission of the run is one
            os.environ["HPCRUN_RESTART_COUNT"] = str(len(read_jobs(run_dir)))
        else:
            require_sbatch(spec)
            executor = RenderedSlurmExecutor(spec, script, dependency)
        # submitit echoes sbatch's stderr; the refusal is reported once, below
        with contextlib.redirect_stderr(io.StringIO()):
            job = executor.submit(task_run, str(run_dir / SPEC_FILE))
    except (FailedJobError, subprocess.CalledProcessError, RuntimeError) as exc:
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
        message = str(exc).strip().splitlines()
        refusal = next((line for line in message if "sbatch: error" in line or "error:" in line.lower()), message[-1] if message else "")
        raise SubmissionError(f"submission refused: {refusal.strip()}") from exc
    record_job(run_dir, str(job.job_id), spec.site.scheduler)
    return str(job.job_id)


def submit_array(specs: list[RunSpec], log_folder: Path, max_concurrent: int | None) -> list[str]:
    """Points of one shape as one job array with one rendered script; returns their job ids
    (`<array>_<index>`). A refused array leaves none of its run directories behind."""
    require_sbatch(specs[0])
    array = f"0-{len(specs) - 1}" + (f"%{max_concurrent}" if max_concurrent else "")
    script = render(specs[0], array=array, log_folder=log_folder)
    fresh = [not (Path(spec.run_dir) / JOBS_FILE).exists() for spec in specs]
    run_dirs = [prepare(spec, script) for spec in specs]
    executor = RenderedSlurmExecutor(specs[0], script, folder=log_folder)
    try:
        with contextlib.redirect_stderr(io.StringIO()), executor.batch():
            jobs = [executor.submit(task_run, str(d / SPEC_FILE)) for d in run_dirs]
    except (FailedJobError, subprocess.CalledProcessError, RuntimeError) as exc:
        for run_dir, new in zip(run_dirs, fresh):
            if new:  # a retried point keeps its history and checkpoints
                shutil.rmtree(run_dir, ignore_errors=True)
        raise SubmissionError(f"array submission refused: {str(exc).strip().splitlines()[-1]}") from exc
    for run_dir, job in zip(run_dirs, jobs):
        record_job(run_dir, str(job.job_id), "slurm", log_folder=str(log_folder))
    return [str(job.job_id) for job in jobs]


def record_job(run_dir: Path, job_id: str, scheduler: str, **extra: str) -> None:
    jobs = read_jobs(run_dir)
    jobs.append({"job_id": job_id, "scheduler": scheduler, "submitted": time.time(), **extra})
    tmp = run_dir / f".{JOBS_FILE}.tmp"
    tmp.write_text(json.dumps(jobs, indent=1))
    tmp.replace(run_dir / JOBS_FILE)


def read_jobs(run_dir: Path) -> list[dict[str, tp.Any]]:
    try:
        return list(json.loads((run_dir / JOBS_FILE).read_text()))
    except (OSError, ValueError):
        return []


def load_spec(run_dir: Path) -> RunSpec:
    try:
        return RunSpec.model_validate_json((run_dir / SPEC_FILE).read_text())
    except OSError as exc:
        raise HpcrunError("not a run directory (no runspec.json)", run_dir) from exc
