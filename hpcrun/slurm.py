"""SLURM's command-line tools, called the one way: a missing tool or a controller that does not
answer is one line naming the tool, never a traceback. hpcrun submits with `sbatch` itself,
because the script it submits is its own rendered template (see DESIGN: submitit has no public
hook for the script text)."""

from __future__ import annotations

import datetime as dt
import getpass
import os
import pwd
import re
import shutil
import socket
import subprocess
import time
import typing as tp
from pathlib import Path

from hpcrun.errors import HpcrunError, SubmissionError, ToolError

TIMEOUT_S = 60


# Set by the batch script of a job whose ranks run in a container: a directory where they ask it
# to run the SLURM tools the container lacks (`through_batch_script`)
PROXY_ENV = "HPCRUN_SLURM_PROXY"
PROXIED = ("scontrol", "sacct", "sinfo", "squeue", "srun")  # the tools the batch script runs for them (sbatch.sh.j2)


def run(cmd: list[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run a SLURM tool (within `timeout`, TIMEOUT_S by default); the caller reads its return
    code and output. A tool that cannot be started or does not answer is one line naming it. A
    tool missing here (not found, or a shell's 127) in a container's job goes to the batch script."""
    limit = TIMEOUT_S if timeout is None else timeout
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except FileNotFoundError as exc:
        asked = through_batch_script(cmd, limit)
        if asked is None:
            raise ToolError(f"{cmd[0]} is not on PATH: this needs a SLURM login node") from exc
        return asked
    except PermissionError as exc:
        raise ToolError(f"{cmd[0]} is not executable ({_where(cmd[0])}): permission denied") from exc
    except OSError as exc:  # e.g. a wrapper script without its #! line (ENOEXEC)
        raise ToolError(f"{cmd[0]} could not be started ({_where(cmd[0])}): {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise HpcrunError(f"{cmd[0]} did not answer within {limit:g} s: is slurmctld reachable?") from exc
    if out.returncode == 127 and not out.stdout:  # a shell's "not found": a wrapper without its tool
        return through_batch_script(cmd, limit) or out
    return out


def through_batch_script(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str] | None:
    """`cmd` run by the job's batch script (outside the container, beside SLURM's clients), when it
    offers to (PROXY_ENV) and `cmd` is one of PROXIED; None otherwise. A request is one file of
    the words, NUL-separated, renamed into place; the answer is the tool's output and error, then
    its exit status, written last."""
    directory = os.environ.get(PROXY_ENV)
    if not directory or os.path.basename(cmd[0]) not in PROXIED:
        return None
    base = f"{directory}/{socket.gethostname()}-{os.getpid()}-{time.monotonic_ns()}"
    partial, request, status = Path(f"{base}.part"), Path(f"{base}.req"), Path(f"{base}.rc")
    try:
        partial.write_bytes(b"".join(w.encode() + b"\0" for w in [os.path.basename(cmd[0]), *cmd[1:]]))
        os.replace(partial, request)
    except OSError:  # no such directory: not this job's batch script (a variable inherited from another job)
        return None
    deadline = time.monotonic() + timeout + 10  # the script's own limit, and its polling
    while not status.exists():
        if time.monotonic() > deadline:
            request.unlink(missing_ok=True)
            raise HpcrunError(f"{cmd[0]}, asked of the batch script: no answer within {timeout + 10:g} s")
        time.sleep(0.1)
    answer = [Path(f"{base}.out"), Path(f"{base}.err"), status]
    try:
        out, err, code = (path.read_text(errors="replace") for path in answer)
    finally:
        for path in answer:
            path.unlink(missing_ok=True)
    return subprocess.CompletedProcess(cmd, int(code.strip() or 1), out, err)


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


def node_name(environ: tp.Mapping[str, str]) -> str:
    """This node's name as SLURM knows it (SLURMD_NODENAME, as srun names nodes; the test cluster's
    nodes share one hostname), the hostname outside SLURM."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def requeue_count(environ: tp.Mapping[str, str]) -> int:
    """SLURM's count of the job's requeues; hpcrun's local controller says which submission this is."""
    return int(environ.get("SLURM_RESTART_COUNT", environ.get("HPCRUN_REQUEUES", "0")) or 0)


def attempt_number(environ: tp.Mapping[str, str]) -> int:
    """hpcrun's attempt number in the job: every start of its training step, requeues and restarts
    inside the job alike (the batch script counts them: HPCRUN_ATTEMPT)."""
    return int(environ.get("HPCRUN_ATTEMPT") or requeue_count(environ))


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
        plain.append(
            f"{array}_{ranges[0]}" if ranges[0].isdigit() and len(ranges) == 1 else f"{array}_[{','.join(ranges)}]"
        )
    return plain


def require(tool: str, why: str) -> None:
    """`tool` can be run from here: on PATH and executable (ToolError, exit code 2, if not)."""
    if shutil.which(tool) is None:
        where = _where(tool)
        problem = "is not on PATH" if where == tool else f"is not executable ({where})"
        raise ToolError(f"{tool} {problem}: {why}")


TAG_PREFIX = "hpcrun:"
# sbatch's messages when the controller may have taken the job although sbatch saw no answer
UNSURE = ("timed out", "time out", "unable to contact", "zero bytes were transmitted", "connection refused")


class LostAnswer(SubmissionError):
    """sbatch gave no usable answer (it timed out, died, or printed no job id and no refusal):
    SLURM may hold the job, so the caller must look it up by its tag before submitting again.
    Exit code 2, like any SLURM tool that did not answer."""

    exit_code = 2


def comment(tag: str) -> str:
    """The `--comment` a submission tagged `tag` carries (SLURM keeps it with the job), in
    characters that need no quoting on an #SBATCH line."""
    return TAG_PREFIX + re.sub(r"[^A-Za-z0-9._:-]", "_", tag)


def sbatch(script: Path, dependency: str | None = None, timeout: float | None = None) -> str:
    """Submit `script` as it is (its #SBATCH lines carry every option); returns the job id. A
    refusal raises SubmissionError with sbatch's own message; an answer that may hide an accepted
    job raises LostAnswer."""
    deps = [f"--dependency={dependency}"] if dependency else []
    try:
        out = run(["sbatch", "--parsable", *deps, str(script)], timeout)
    except HpcrunError as exc:
        if isinstance(exc.__cause__, subprocess.TimeoutExpired):
            raise LostAnswer(exc.message) from exc
        raise
    if out.returncode != 0:
        lines = said(out).splitlines()
        refusal = next((line.strip() for line in lines if "error" in line.lower()), None)
        if refusal is None or any(word in refusal.lower() for word in UNSURE):
            raise LostAnswer(f"sbatch exited {out.returncode} with no clear refusal ({refusal or 'no message'})")
        raise SubmissionError(f"submission refused: {refusal}")
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    job_id = last.split(";")[0]  # --parsable: "id" or "id;cluster"
    if not job_id.isdigit():
        raise LostAnswer(f"sbatch answered {out.stdout.strip()!r}, not a job id")
    return job_id


def tagged_jobs(scripts: tp.Mapping[str, str], since: float) -> dict[str, list[str]]:
    """The jobs (array ids for arrays) submitted at or after `since` with each tag of `scripts`
    (tag -> the script path given to sbatch) and that script, oldest first: the script tells two
    runs' jobs apart where their tags meet (the same run id in two runs directories). squeue
    knows a job while it is queued, running or recently ended; then sacct does, by its comment
    where accounting stores comments (AccountingStoreFlags=job_comment) and by its SubmitLine."""
    found: dict[str, list[str]] = {}
    for job, submitted, text, command in _squeue_submissions():
        for tag, script in scripts.items():
            if text == comment(tag) and _same_path(command, script) and submitted >= since:
                found.setdefault(tag, []).append(job)
    missing = {tag: script for tag, script in scripts.items() if tag not in found}
    for job, submitted, text, line in _sacct_submissions(since) if missing else []:
        for tag, script in missing.items():
            # an empty comment: accounting does not store comments (SLURM's default)
            if text in ("", comment(tag)) and line.endswith(f" {script}") and submitted >= since:
                found.setdefault(tag, []).append(job)
    return {tag: sorted(set(jobs), key=lambda job: int(job) if job.isdigit() else 0) for tag, jobs in found.items()}


def _same_path(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def _when(text: str) -> float:
    """A time as SLURM's tools print it (local time), as seconds since the epoch; 0 when unknown."""
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return 0.0


def _squeue_submissions() -> list[tuple[str, float, str, str]]:
    """(job or array id, submit time, comment, script) of every job of this user slurmctld holds."""
    out = run(["squeue", "-h", "-u", user(), "-t", "all", "-o", "%F|%V|%k|%o"])
    if out.returncode != 0:
        raise HpcrunError(f"squeue failed, so a lost submission cannot be looked up: {said(out)}")
    # the comment cannot hold "|" (slurm.comment), the script path can: split from the left
    rows = [row for row in (line.split("|", 3) for line in out.stdout.splitlines()) if len(row) == 4]
    return [(job, _when(submitted), text, command) for job, submitted, text, command in rows]


def _sacct_submissions(since: float) -> list[tuple[str, float, str, str]]:
    """(job or array id, submit time, comment, submit line) of this user's jobs since `since`
    from accounting; [] where accounting is disabled."""
    start = dt.datetime.fromtimestamp(since).strftime("%Y-%m-%dT%H:%M:%S")
    fields = "JobID,Submit,Comment,SubmitLine"
    out = run(["sacct", "-X", "-n", "-P", "-u", user(), "-S", start, "-E", "now", "-o", fields])
    if out.returncode != 0:
        if accounting_disabled(out):
            return []
        raise HpcrunError(f"sacct failed, so a lost submission cannot be looked up: {said(out)}")
    rows = [row for row in (line.split("|", 3) for line in out.stdout.splitlines()) if len(row) == 4]
    return [(job.split("_")[0], _when(submitted), text, line) for job, submitted, text, line in rows]


def said(out: subprocess.CompletedProcess[str]) -> str:
    """What a SLURM tool said: its error output, else its output."""
    return out.stderr.strip() or out.stdout.strip()


def accounting_disabled(out: subprocess.CompletedProcess[str]) -> bool:
    """sacct's answer on a cluster without slurmdbd."""
    return "accounting storage is disabled" in (out.stderr + out.stdout).lower()


# The command lines hpcrun sends to SLURM, each built here once; callers run them with `run` and
# read the answer (status, cancel, the failure step, doctor, the sweep's caps).
def sacct_states(jobs: str) -> list[str]:
    """Every record (-D: each requeue) of comma-joined `jobs`: id, state, nodes, elapsed, reason, partition."""
    return ["sacct", "-X", "-D", "-n", "-P", "-j", jobs, "-o", "JobID,State,NodeList,ElapsedRaw,Reason,Partition"]


def squeue_states(jobs: str) -> list[str]:
    return ["squeue", "-h", "-j", jobs, "-o", "%i|%T|%N|%M|%r"]


def scancel(jobs: list[str]) -> list[str]:
    return ["scancel", *compress_ids(jobs)]


def show_job(job: str) -> list[str]:
    return ["scontrol", "show", "job", job]


def requeue(job: str) -> list[str]:
    return ["scontrol", "requeue", job]


def exclude_nodes(job: str, nodes: list[str]) -> list[str]:
    """Set a pending job's ExcNodeList (SLURM keeps it across its later requeues)."""
    return ["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}"]


def attempt_states(allocation: str) -> list[str]:
    return ["sacct", "-X", "-D", "-n", "-P", "-j", allocation, "-o", "State,NodeList"]


def hostnames(node_list: str) -> list[str]:
    return ["scontrol", "show", "hostnames", node_list]


def my_allocations() -> list[str]:
    """The job ids of every job of this user SLURM still knows, one per line."""
    return ["squeue", "-h", "-a", "-u", user(), "-o", "%A"]  # -a: hidden partitions' jobs too


# The batch script's word, in srun's messages, when it ended an srun whose lost tasks never reported
SRUN_ENDED = "[hpcrun] srun ended by the batch script"
# A warm standby's environment variable and the batch script's words to it, a line each on its stdin
# (hpcrun.runtime.standby): import now, become the next attempt, leave
STANDBY_ENV = "HPCRUN_STANDBY"
STANDBY_WARM, STANDBY_GO, STANDBY_EXIT = "warm", "go", "exit"
# How long the batch script's probe of a node (a step of `true`) and of the controller may take (a live one:
# milliseconds)
PROBE_S = 5


def node_states(nodes: list[str]) -> list[str]:
    return ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"]


def show_partition(partition: str | None = None) -> list[str]:
    """One partition, or (None) every partition, hidden ones too, one per line."""
    return ["scontrol", "show", "partition", partition] if partition else ["scontrol", "-a", "show", "partition", "-o"]


def partition_field(partition: str, name: str) -> str | None:
    """One field of `scontrol show partition` (TotalNodes, PreemptMode, ...); None when SLURM does
    not say. A tool that cannot be started or does not answer raises, as `run` does."""
    out = run(show_partition(partition))
    found = re.search(rf"\b{re.escape(name)}=(\S+)", out.stdout) if out.returncode == 0 else None
    return found[1] if found else None


def partitions_summary() -> list[str]:
    return ["sinfo", "-h", "-o", "%R|%D|%c|%m|%G|%l"]


def associations(where: list[str], fields: str) -> list[str]:
    return ["sacctmgr", "-n", "-P", "show", "assoc", "where", *where, f"format={fields}"]


def qos_caps() -> list[str]:
    return ["sacctmgr", "-n", "-P", "show", "qos", "format=Name,MaxSubmitPU,MaxSubmitPA,Flags"]


def show_config() -> list[str]:
    return ["scontrol", "show", "config"]


def held_jobs(select: list[str]) -> list[str]:
    """Queued and running jobs, an array's pending tasks one per line (-r), hidden partitions' too (-a)."""
    return ["squeue", "-h", "-r", "-a", *select, "-o", "%u|%a|%q|%P"]


def test_only(script: str) -> list[str]:
    return ["sbatch", "--test-only", script]
