"""Where runs stand: one batched `sacct` for every SLURM job asked about; `squeue` plus the
run directories' markers where accounting is disabled; process liveness for local runs.
Read-only: cancelling is hpcrun.cancel, finding and following logs is hpcrun.logs."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import typing as tp
from pathlib import Path

from hpcrun import jobstate, localjob, pollcache, progress, slurm
from hpcrun.errors import HpcrunError
from hpcrun.progress import Progress
from hpcrun.rundir import RunDir

MAX_WAIT_AGE_S = 30.0  # the oldest scheduler answer a long --wait accepts (hpcrun.status.scheduler_age)


@dataclasses.dataclass
class RunStatus:
    run_id: str
    job_id: str
    state: str
    nodes: str = ""
    elapsed_s: int | None = None
    requeues: int = 0
    """Requeues (each a trip through the queue)."""
    reason: str = ""
    source: str = "sacct"
    progress: Progress | None = None  # rank 0's latest progress.json (any of the run's jobs)
    submitted: float | None = None  # when the job was submitted (jobs.json): local runs' elapsed time
    in_job: int = 0
    """Restarts of the training step inside the job's allocations (fault.restarts_in_job)."""

    @property
    def done(self) -> bool:
        return jobstate.done(self.state)


@dataclasses.dataclass
class SchedulerRow:
    state: str
    nodes: str
    elapsed_s: int | None
    reason: str
    records: int = 1
    partition: str = ""


NO_ACCOUNTING = "# accounting storage is disabled\n"  # sacct's answer on a cluster without slurmdbd


def sacct(job_ids: list[str], max_age: float = pollcache.POLL_S) -> dict[str, SchedulerRow] | None:
    """Every requeue of `job_ids` (with -D, each is a record: the requeue count), from one
    `sacct` call that this user's hpcrun processes share (hpcrun.pollcache). None when
    accounting is disabled."""
    if not job_ids:
        return {}
    text = pollcache.shared("sacct", job_ids, max_age, _ask_sacct)
    return None if text == NO_ACCOUNTING else parse_sacct(text)


IDS_PER_CALL = 2000  # one argument of at most ~30 KB (Linux allows 128 KiB per argument)


def id_groups(job_ids: list[str]) -> list[str]:
    """`job_ids` as comma-joined groups small enough for one command-line argument each."""
    return [",".join(job_ids[i : i + IDS_PER_CALL]) for i in range(0, len(job_ids), IDS_PER_CALL)]


def _ask_sacct(job_ids: list[str]) -> str:
    text = ""
    for group in id_groups(job_ids):
        out = slurm.run(slurm.sacct_states(group))
        if out.returncode != 0:
            if slurm.accounting_disabled(out):
                return NO_ACCOUNTING
            raise HpcrunError(f"sacct failed: {slurm.said(out)}")
        text += out.stdout
    return text


def parse_sacct(text: str) -> dict[str, SchedulerRow]:
    rows: dict[str, SchedulerRow] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 5:
            continue
        job, state, nodes, elapsed, reason = parts[:5]
        state = jobstate.of(state).name  # "CANCELLED by 0" -> CANCELLED
        previous = rows.get(job)
        records = (previous.records + 1) if previous else 1
        partition = parts[5] if len(parts) > 5 else ""
        rows[job] = SchedulerRow(state, nodes, int(elapsed) if elapsed.isdigit() else None, reason, records, partition)
    return rows


def squeue(job_ids: list[str], max_age: float = pollcache.POLL_S) -> dict[str, SchedulerRow]:
    """The queued ones of `job_ids`, from one `squeue` call shared like sacct's (slurmctld is the
    daemon that suffers most from polling)."""
    if not job_ids:
        return {}
    rows = {}
    for line in pollcache.shared("squeue", job_ids, max_age, _ask_squeue).splitlines():
        parts = line.split("|")
        if len(parts) == 5:
            rows[parts[0]] = SchedulerRow(parts[1], parts[2], _elapsed(parts[3]), parts[4])
    return rows


def _ask_squeue(job_ids: list[str]) -> str:
    text = ""
    for group in id_groups(job_ids):
        out = slurm.run(slurm.squeue_states(group))
        if out.returncode != 0 and "invalid job id" not in out.stderr.lower():  # every job already left the queue
            raise HpcrunError(f"squeue failed: {slurm.said(out)}")
        text += out.stdout
    return text


def _elapsed(text: str) -> int | None:
    try:
        days, _, rest = text.rpartition("-")
        nums = [int(x) for x in rest.split(":")]
        while len(nums) < 3:
            nums.insert(0, 0)
        return int(days or 0) * 86400 + nums[0] * 3600 + nums[1] * 60 + nums[2]
    except ValueError:
        return None


def marker(run_dir: Path) -> dict[str, tp.Any]:
    """The runtime's own last word on the run (written by rank 0 at the end of each attempt)."""
    return RunDir(run_dir).state()


def alive(pid: str) -> bool:
    """Whether a local job's controller still runs. When this process started it (submit
    --wait), a finished controller is a zombie until reaped, and kill(pid, 0) still succeeds."""
    try:
        number = int(pid)
        try:
            if os.waitpid(number, os.WNOHANG)[0] == number:
                return False
        except ChildProcessError:
            pass
        os.kill(number, 0)
    except (OSError, ValueError):
        return False
    try:
        return Path(f"/proc/{number}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def controller_alive(pid: str, run_dir: Path) -> bool:
    """Whether `pid` still runs as this run's local controller (`python -m hpcrun.localjob <run
    dir>`, from its /proc cmdline): the pid recorded in jobs.json may since have been reused by
    another process, which `cancel` must never signal."""
    if not alive(pid):
        return False
    proc = Path(f"/proc/{int(pid)}")
    try:
        words = [os.fsdecode(w) for w in (proc / "cmdline").read_bytes().split(b"\0")]
        if localjob.__name__ not in words[:-1]:
            return False
        given = words[words.index(localjob.__name__) + 1]
        if not os.path.isabs(given):  # relative to the controller's own working directory
            given = os.path.join(os.readlink(proc / "cwd"), given)
    except OSError:
        return False
    return os.path.realpath(given) == os.path.realpath(run_dir)


def statuses(run_dirs: list[Path], max_age: float = pollcache.POLL_S) -> list[RunStatus]:
    """The status of each run (its latest job) and its progress, with one scheduler query for
    all of them, or none when this user's last one is younger than `max_age` (hpcrun.pollcache)."""
    result = [
        dataclasses.replace(s, progress=progress.read(Path(d)))
        for d, s in zip(run_dirs, _scheduled(run_dirs, max_age))
        if s is not None
    ]
    now = time.time()
    for status in result:
        p = status.progress
        mine = p if p is not None and p.job_id == status.job_id else None  # this job's, not an earlier one's
        if mine is not None:  # the attempt now running may not have ended yet; its number counts both kinds
            status.requeues = max(status.requeues, mine.attempt - status.in_job)
        if status.source == "local" and status.elapsed_s is None and status.submitted is not None:
            end = now if status.state == jobstate.RUNNING else (mine.updated if mine is not None else None)
            status.elapsed_s = None if end is None else max(0, int(end - status.submitted))
    return result


def _scheduled(run_dirs: list[Path], max_age: float) -> list[RunStatus | None]:
    """What the scheduler (or, for local runs, the controller's liveness) and the runtime's
    marker say of each run's latest job; None for a run never submitted."""
    latest = {d: job for d in run_dirs if (job := RunDir(d).latest_job())}
    slurm_ids = [j["job_id"] for j in latest.values() if j["scheduler"] == "slurm"]
    rows = sacct(slurm_ids, max_age)
    source = "sacct"
    if rows is None:
        rows, source = squeue(slurm_ids, max_age), "squeue+markers (accounting disabled)"
    result: list[RunStatus | None] = []
    for run_dir in run_dirs:
        job = latest.get(run_dir)
        if job is None:
            intent = RunDir(run_dir).intent()  # sent, its answer lost: SLURM may hold it (hpcrun.backend.settle)
            why = "sbatch's answer is not recorded; the next submit, resume or sweep looks the job up"
            pending = RunStatus(run_dir.name, "?", jobstate.SUBMITTING, reason=why, source="intent")
            result.append(None if intent is None else pending)
            continue
        mark = marker(run_dir)
        own = mark if mark.get("job_id") == job["job_id"] else {}
        in_job = int(own.get(jobstate.IN_JOB) or 0)
        if job["scheduler"] == "local":
            state = jobstate.RUNNING if alive(job["job_id"]) else jobstate.from_marker(own.get("status", ""))
            submitted = job.get("submitted")
            since = float(submitted) if isinstance(submitted, (int, float)) else None
            result.append(
                RunStatus(
                    run_dir.name,
                    job["job_id"],
                    state,
                    "localhost",
                    None,
                    int(own.get("attempt", 0)),
                    run_notes(own.get("reason") or "", mark),
                    "local",
                    submitted=since,
                )
            )
            continue
        row = rows.get(job["job_id"])
        if row is None:
            unheard = jobstate.UNKNOWN if source == "sacct" else jobstate.LEFT_QUEUE  # not in sacct yet / left squeue
            state = jobstate.from_marker(own.get("status", "")) if own else unheard
            result.append(
                RunStatus(
                    run_dir.name,
                    job["job_id"],
                    state,
                    "",
                    None,
                    int(own.get("attempt", 0)) - in_job,
                    run_notes(own.get("reason") or "", mark),
                    source,
                    in_job=in_job,
                )
            )
            continue
        state = row.state
        if state == jobstate.PREEMPTED and not requeues_preempted(row.partition):
            state = jobstate.PREEMPTED_CANCELLED
        if state == jobstate.COMPLETED and own.get("status") not in (None, "completed"):
            # the batch script ended well, the attempt did not: failed (the requeue cap), or
            # stopped and saved but not requeued (a requeue sacct would show as REQUEUED)
            state = jobstate.FAILED if own["status"] == "failed" else jobstate.RESUMABLE
        reason = own.get("reason") or ("" if row.reason in ("None", "") else row.reason)
        result.append(
            RunStatus(
                run_dir.name,
                job["job_id"],
                state,
                row.nodes,
                row.elapsed_s,
                row.records - 1,
                run_notes(reason, mark),
                source,
                in_job=in_job,
            )
        )
    return result


PREEMPT_MODES: dict[str, bool] = {}  # partition -> whether SLURM requeues its preempted jobs (this process's answers)


def requeues_preempted(partition: str) -> bool:
    """Whether SLURM requeues a job preempted in `partition` (its PreemptMode, which `scontrol`
    shows with the cluster's default filled in, has REQUEUE): else a PREEMPTED job is over.
    Asked once per partition in a process; no answer counts as requeued (SLURM's usual setting,
    as before the partition was read) and is asked again next time. Where preemption is by QOS
    (PreemptType=preempt/qos) the QOS's mode applies, which this does not read."""
    if not partition:
        return True
    if partition not in PREEMPT_MODES:
        try:
            mode = slurm.partition_field(partition.split(",")[0], "PreemptMode")
        except HpcrunError:
            return True
        if mode is None:
            return True
        PREEMPT_MODES[partition] = "REQUEUE" in mode.upper().split(",")
    return PREEMPT_MODES[partition]


def run_notes(reason: str, mark: dict[str, tp.Any]) -> str:
    """The attempt's reason and what the run as a whole learnt, whichever attempt learnt it:
    ranks named slow while training (hpcrun.runtime.straggler) and the nodes excluded."""
    if mark.get("slow_ranks"):
        slow = ", ".join(
            f"{who} ({ratio:.1f}x)" if isinstance(ratio, (int, float)) else str(who)
            for who, ratio in sorted(mark["slow_ranks"].items())
        )
        reason = f"{reason}; slow: {slow}"
    if mark.get("excluded_nodes"):
        reason = f"{reason}; excluding {','.join(mark['excluded_nodes'])}"
    return reason.lstrip("; ")


def goodput_line(run_dir: Path, status: RunStatus) -> str | None:
    """One run's goodput and its seconds lost by cause (hpcrun.goodput), when it has failed
    attempts: its own rows are read only for a run that has had more than one attempt, so the
    view of a run that never restarted reads no results."""
    if not (status.requeues or status.in_job):
        return None
    from hpcrun.goodput import COLUMNS, goodput
    from hpcrun.results import run_rows
    from hpcrun.rundir import CorruptStateError, read_json

    try:
        spec = read_json(RunDir(run_dir).spec, {})
    except CorruptStateError:
        return None
    if not (isinstance(spec, dict) and spec.get("results_dir")):
        return None
    found = goodput(run_rows(spec["results_dir"], str(spec.get("run_id") or status.run_id), COLUMNS))
    return found.line() if found is not None and found.failures else None


def scheduler_age(waited_s: float) -> float:
    """How old a scheduler answer a long wait accepts: POLL_S for the first minute, then a
    twentieth of the time waited, at most MAX_WAIT_AGE_S (a day-long wait asks twice a minute;
    the progress files, on the filesystem, are still read every poll)."""
    return min(MAX_WAIT_AGE_S, max(pollcache.POLL_S, waited_s / 20))


def wait(
    run_dirs: list[Path],
    timeout: float | None = None,
    on_change: tp.Callable[[list[RunStatus]], None] | None = None,
    on_poll: tp.Callable[[list[RunStatus]], None] | None = None,
    interval: float = 1.0,
) -> list[RunStatus]:
    """Poll until every run has ended or `timeout` passes; `on_change` sees each new set of
    states, `on_poll` every poll (progress moves between state changes). The scheduler is asked
    at most once per `scheduler_age` (shared with this user's other hpcrun processes); a failed
    query after a good one is reported on stderr and the last states kept. Returns the last states."""
    started = time.time()
    deadline = None if timeout is None else started + timeout
    shown: list[tuple[str, str, int]] = []
    current: list[RunStatus] = []
    failed = ""
    pause = interval
    while True:
        polled = time.monotonic()
        try:
            # an answer as old as this watcher's own pause will do: ten watchers sharing answers
            # then ask no more often than one alone
            current = statuses(run_dirs, max(pause, scheduler_age(time.time() - started)))
        except HpcrunError as exc:
            if not current:
                raise
            if exc.format_message() != failed:  # once per distinct failure, not once per poll
                failed = exc.format_message()
                print(
                    f"[hpcrun] scheduler query failed, keeping the last states: {failed}", file=sys.stderr, flush=True
                )
        key = [(s.run_id, s.state, s.requeues) for s in current]
        if on_change and key != shown:
            on_change(current)
            shown = key
        if on_poll:
            on_poll(current)
        if (current and all(s.done for s in current)) or (deadline is not None and time.time() >= deadline):
            return current
        # a watcher of thousands of runs (their files are read every poll) spends at most a
        # quarter of its time polling: a login node is shared
        pause = max(interval, 3 * (time.monotonic() - polled))
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.time())))
