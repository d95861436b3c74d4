"""SLURM's command-line tools, called the one way: a missing tool or a controller that does not
answer is one line naming the tool, never a traceback. hpcrun submits with `sbatch` itself,
because the script it submits is its own rendered template (see DESIGN: submitit has no public
hook for the script text)."""

from __future__ import annotations

import getpass
import os
import pwd
import shutil
import subprocess
import typing as tp
from pathlib import Path

from hpcrun.errors import HpcrunError, SubmissionError, ToolError

TIMEOUT_S = 60


def run(cmd: list[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run a SLURM tool (within `timeout`, TIMEOUT_S by default); the caller reads its return
    code and output. A tool that cannot be started or does not answer is one line naming it."""
    limit = TIMEOUT_S if timeout is None else timeout
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except FileNotFoundError as exc:
        raise ToolError(f"{cmd[0]} is not on PATH: this needs a SLURM login node") from exc
    except PermissionError as exc:
        raise ToolError(f"{cmd[0]} is not executable ({_where(cmd[0])}): permission denied") from exc
    except OSError as exc:  # e.g. a wrapper script without its #! line (ENOEXEC)
        raise ToolError(f"{cmd[0]} could not be started ({_where(cmd[0])}): {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise HpcrunError(f"{cmd[0]} did not answer within {limit:g} s: is slurmctld reachable?") from exc


def _where(tool: str) -> str:
    """The first file named `tool` on PATH, executable or not (shutil.which skips the latter)."""
    if os.sep in tool:
        return tool
    found = (Path(d) / tool for d in os.environ.get("PATH", os.defpath).split(os.pathsep) if d)
    return str(next((p for p in found if p.is_file()), tool))


def user() -> str:
    """The user SLURM holds jobs and limits under: the name of this process's uid. Not $USER
    first (getpass): setpriv, and `su`/`runuser` to root without `-`, leave it naming the user
    before, whose association (and MaxSubmitJobs) SLURM would not apply. A uid with no passwd
    entry (a container, a directory service down) falls back to $USER."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return getpass.getuser()


def job_id(environ: tp.Mapping[str, str]) -> str:
    """The id SLURM's tools take for the job these variables describe: `<array>_<index>` for
    an array task (SLURM_JOB_ID is then the task's own allocation), else SLURM_JOB_ID. The one
    spelling: the ranks, the failure step and requeue all use it."""
    array = environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{environ['SLURM_ARRAY_TASK_ID']}" if array else environ["SLURM_JOB_ID"]


def compress_ids(job_ids: list[str]) -> list[str]:
    """Job ids as SLURM's tools take them, each array once: ["7", "9_0", "9_1", "9_2", "9_5"] ->
    ["7", "9_[0-2,5]"] (one argument, one request per array instead of one per task)."""
    plain: list[str] = []
    tasks: dict[str, list[int]] = {}
    for job in job_ids:
        array, _, task = job.partition("_")
        if task.isdigit():
            tasks.setdefault(array, []).append(int(task))
        else:
            plain.append(job)
    for array, numbers in tasks.items():
        ranges: list[str] = []
        for n in sorted(set(numbers)):
            if ranges and ranges[-1].split("-")[-1] == str(n - 1):
                ranges[-1] = f"{ranges[-1].split('-')[0]}-{n}"
            else:
                ranges.append(str(n))
        plain.append(f"{array}_{ranges[0]}" if ranges[0].isdigit() and len(ranges) == 1 else f"{array}_[{','.join(ranges)}]")
    return plain


def require(tool: str, why: str) -> None:
    """`tool` can be run from here: on PATH and executable (ToolError, exit code 2, if not)."""
    if shutil.which(tool) is None:
        where = _where(tool)
        problem = "is not on PATH" if where == tool else f"is not executable ({where})"
        raise ToolError(f"{tool} {problem}: {why}")


def sbatch(script: Path, dependency: str | None = None) -> str:
    """Submit `script` as it is (its #SBATCH lines carry every option); returns the job id. A
    refusal raises SubmissionError with sbatch's own message."""
    deps = [f"--dependency={dependency}"] if dependency else []
    out = run(["sbatch", "--parsable", *deps, str(script)])
    if out.returncode != 0:
        lines = (out.stderr.strip() or out.stdout.strip()).splitlines()
        refusal = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else f"exit status {out.returncode}")
        raise SubmissionError(f"submission refused: {refusal.strip()}")
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    job_id = last.split(";")[0]  # --parsable: "id" or "id;cluster"
    if not job_id.isdigit():
        raise SubmissionError(f"sbatch answered {out.stdout.strip()!r}, not a job id")
    return job_id
