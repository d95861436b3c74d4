"""Job states, in one table: every state SLURM's tools print (sacct, squeue, scontrol; SLURM
22.05 to 24.x) and hpcrun's own, with what each means to hpcrun. Everyone who asks "has this
job ended, and how?" asks here, so a state cannot be finished in one place and running in
another (a SUSPENDED job is not over; a PREEMPTED one is coming back)."""

from __future__ import annotations

import dataclasses
import enum

# state.json's count of a job's restarts inside its allocations (fault.restarts_in_job; status's IN-JOB)
IN_JOB = "restarts_in_job"
# state.json's count of a job's requeues after a stop at its time limit (checkpoint.max_timeouts)
TIMEOUTS = "timeouts"


class Phase(enum.Enum):
    PENDING = "pending"  # not started yet, or held: waits for SLURM or a person
    ACTIVE = "active"  # holds (or is getting, or giving back) an allocation, paused or not
    RETURNING = "returning"  # this attempt ended and SLURM requeues the job: it will run again
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # ended for good without completing (a resubmission may continue it)


@dataclasses.dataclass(frozen=True)
class JobState:
    name: str
    phase: Phase
    meaning: str

    @property
    def done(self) -> bool:
        """Over for good: nothing will run again unless someone submits again."""
        return self.phase in (Phase.SUCCEEDED, Phase.FAILED)


_P, _A, _R, _S, _F = Phase.PENDING, Phase.ACTIVE, Phase.RETURNING, Phase.SUCCEEDED, Phase.FAILED
TABLE: dict[str, JobState] = {s.name: s for s in (
    JobState("BOOT_FAIL", _F, "a node failed to boot for the job"),
    JobState("CANCELLED", _F, "cancelled by a user or an administrator"),
    JobState("COMPLETED", _S, "every process exited with status 0"),
    JobState("COMPLETING", _A, "ending: some processes or epilogs still run"),
    JobState("CONFIGURING", _A, "allocated, its nodes still booting"),
    JobState("DEADLINE", _F, "passed its --deadline"),
    JobState("FAILED", _F, "the batch script exited non-zero"),
    # with requeue SLURM starts a new record for the next attempt; the lost node's is final
    JobState("NODE_FAIL", _F, "a node of the job stopped answering"),
    JobState("OUT_OF_MEMORY", _F, "a process exceeded its memory"),
    JobState("PENDING", _P, "queued, waiting for resources or a dependency"),
    # PreemptMode=REQUEUE (the test cluster's, the common one): SLURM queues it again
    JobState("PREEMPTED", _R, "preempted by a higher-priority job; requeued by SLURM"),
    # PreemptMode=CANCEL (or a preemption SLURM did not requeue): hpcrun's name for it, read from the partition
    JobState("PREEMPTED_CANCELLED", _F, "preempted by a higher-priority job and cancelled (PreemptMode=CANCEL)"),
    JobState("REQUEUED", _R, "requeued; runs again once eligible"),
    JobState("REQUEUE_FED", _R, "requeued by its federation"),
    JobState("REQUEUE_HOLD", _P, "requeued and held: runs again once released"),
    JobState("RESIZING", _A, "its allocation is changing size"),
    # a federated job's copy here, dropped because another cluster started it
    JobState("REVOKED", _F, "revoked: a sibling cluster runs it, not this one"),
    JobState("RUNNING", _A, "running"),
    JobState("SIGNALING", _A, "being signalled"),
    JobState("SPECIAL_EXIT", _P, "requeued in the special-exit state and held: runs again once released"),
    JobState("STAGE_OUT", _A, "ran; staging files out of a burst buffer"),
    JobState("STOPPED", _A, "stopped (SIGSTOP) with its allocation kept: resumes with SIGCONT"),
    JobState("SUSPENDED", _A, "suspended with its allocation kept: resumes"),
    JobState("TIMEOUT", _F, "killed at its time limit"),
    # hpcrun's own, where SLURM does not say
    JobState("UNKNOWN", _P, "hpcrun: accounting holds no record of it yet (just submitted)"),
    JobState("LEFT_QUEUE", _F, "hpcrun: gone from squeue without a word from the run (no accounting)"),
    JobState("RESUMABLE", _F, "hpcrun: stopped after saving a checkpoint; `hpcrun resume` continues it"),
    JobState("SUBMITTING", _P, "hpcrun: sent; sbatch's answer not recorded yet (looked up at the next submit)"),
)}

COMPLETED, FAILED, RUNNING, COMPLETING, NODE_FAIL = "COMPLETED", "FAILED", "RUNNING", "COMPLETING", "NODE_FAIL"
UNKNOWN, LEFT_QUEUE, RESUMABLE, REQUEUED = "UNKNOWN", "LEFT_QUEUE", "RESUMABLE", "REQUEUED"
PREEMPTED, PREEMPTED_CANCELLED = "PREEMPTED", "PREEMPTED_CANCELLED"
SUBMITTING = "SUBMITTING"

# state.json's `status` (the runtime's word on an attempt) -> the state it stands for when
# the scheduler says nothing (local runs, a cluster without accounting); any other (`requeueing`:
# the job left the queue although a requeue was under way) ended without saying how
MARKERS = {"completed": COMPLETED, "failed": FAILED, "stopped": RESUMABLE, "requeued": REQUEUED}


def of(name: str) -> JobState:
    """The row of `name` (sacct's `CANCELLED by 0` is CANCELLED). A state this table does not
    know (a newer SLURM's) counts as active: waiting on it is bounded by `--timeout`, while
    reading it as ended could resubmit a job that still runs."""
    word = name.split()[0] if name.strip() else UNKNOWN
    return TABLE.get(word) or JobState(word, Phase.ACTIVE, "not known to hpcrun")


def done(name: str) -> bool:
    return of(name).done


def phase(name: str) -> Phase:
    return of(name).phase


def failed(name: str) -> bool:
    """Ended for good without completing: what `hpcrun sweep --retry-failed` submits again."""
    return phase(name) is Phase.FAILED


def from_marker(status: str) -> str:
    """The state an attempt's recorded end stands for; a marker without a known end is FAILED
    (the run ended without saying how)."""
    return MARKERS.get(status, FAILED)
