"""Requeueing a job through SLURM, and state.json saying what SLURM did.

A requeue is recorded before it is asked for (state.json's REQUEUEING) and settled after SLURM's
answer: `requeued`, or `stopped` with why not. So state.json never claims a requeue SLURM did not
make. SLURM updates a job's ExcNodeList only while it is pending, so the nodes the run excludes
are set right after each requeue hpcrun makes.

Runs on the batch node after srun too: imports no torch.
"""

from __future__ import annotations

import re
import signal
import sys
import typing as tp

from hpcrun import jobstate, slurm
from hpcrun.errors import HpcrunError
from hpcrun.rundir import RunDir

# state.json's status from the decision to requeue until SLURM's answer (settle): then
# `requeued`, or `stopped` with why not
REQUEUEING = "requeueing"


def requeue(
    run_dir: RunDir | None, job: str, attempt: int, slurm_requeues: int | None = None, last_try: bool = True
) -> None:
    """Requeue `job` after its `attempt`, unless SLURM is already doing so (preemption and
    NODE_FAIL requeue by themselves, and twice would count twice); then, while it is pending (the
    only time SLURM accepts it), exclude the nodes this run lost. SLURM holds a requeued job for
    the site's `AuthInfo=cred_expire` (120 s by default) before it may start again, so the
    exclusion lands before that. state.json then says what SLURM did (`settle`). A SLURM tool that
    fails is one line (HpcrunError); unless it was the `last_try`, the attempt stays REQUEUEING for
    the failure step, which tries again. `attempt` is hpcrun's attempt number, `slurm_requeues`
    SLURM's count (the same unless the job restarted inside itself)."""
    try:
        why_not = _requeue(run_dir, job, attempt if slurm_requeues is None else slurm_requeues)
    except HpcrunError as exc:
        if last_try:
            settle(run_dir, job, attempt, f"not requeued: {exc.format_message()}")
        raise
    settle(run_dir, job, attempt, why_not)


def _requeue(run_dir: RunDir | None, job: str, slurm_requeues: int) -> str | None:
    """None once the job is requeued, else why it is not."""
    shown = slurm.run(slurm.show_job(job))
    if shown.returncode != 0:
        raise HpcrunError(f"scontrol show job {job} failed: {one_line(shown)}")
    fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
    if int(fields.get("Restarts") or 0) > slurm_requeues:  # SLURM counts a requeue as it makes it
        return None
    if fields.get("JobState") != jobstate.RUNNING:  # cancelled, or ended by its batch shell
        return f"not requeued: the job is {fields.get('JobState') or 'gone'}"
    excluded = (run_dir.state().get("excluded_nodes") or []) if run_dir else []
    # Requeueing sends SIGTERM to every process of the job, this one included: ignored until
    # the exclusion is set (SIGKILL follows only after the cluster's KillWait). Not
    # `requeuehold` + `release`: killed in between, that would leave the job held for good.
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        done = slurm.run(slurm.requeue(job))
        if done.returncode != 0:
            raise HpcrunError(f"scontrol requeue {job} failed: {one_line(done)}")
        if excluded:
            update = slurm.run(slurm.exclude_nodes(job, list(excluded)))
            if update.returncode != 0:
                print(
                    f"[hpcrun] requeued {job}, but could not exclude {','.join(excluded)}: {one_line(update)}",
                    file=sys.stderr,
                )
    finally:
        signal.signal(signal.SIGTERM, previous)
    return None


def settle(run_dir: RunDir | None, job: str, attempt: int, why_not: str | None) -> None:
    """state.json's attempt, recorded as going to be requeued (REQUEUEING, or a failure's reason
    ending in `; requeueing`), says what SLURM did: requeued, or stopped (resumable) and why not.
    So state.json never claims a requeue SLURM did not make."""
    if run_dir is None:
        return

    def merge(state: dict[str, tp.Any]) -> dict[str, tp.Any] | None:
        if (state.get("job_id"), state.get("attempt")) != (job, attempt):
            return None
        reason = state.get("reason") or ""
        if state.get("status") == REQUEUEING:
            if why_not:
                return {**state, "status": "stopped", "reason": f"{reason}; {why_not}"}
            return {**state, "status": "requeued"}
        if state.get("status") == "failed" and reason.endswith(f"; {REQUEUEING}"):
            return {**state, "reason": f"{reason.removesuffix(REQUEUEING)}{why_not or 'requeued'}"}
        return None

    run_dir.update_state(merge)


def one_line(out: tp.Any) -> str:
    """A failed SLURM tool's message, on one line."""
    text = (out.stderr or out.stdout or "").strip()
    return text.splitlines()[-1] if text else f"exit status {out.returncode}"


def sacct_attempts(allocation_id: str) -> list[tuple[str, str]]:
    """(state, node list) of each start of the job, oldest first (a requeue adds one)."""
    out = slurm.run(slurm.attempt_states(allocation_id))
    if out.returncode != 0:
        raise HpcrunError(f"sacct -j {allocation_id} failed: {one_line(out)}")
    return [tuple(line.split("|")[:2]) for line in out.stdout.splitlines() if "|" in line]  # type: ignore[misc]
