"""What SLURM accepts from this user now: the largest array (MaxArraySize) and how many more jobs
(MaxSubmitJobs) before the controller refuses one. A sweep submits within both, so that no
array is refused halfway through it; the rest is deferred to a later `hpcrun sweep`.

Where the job cap comes from: SLURM takes each limit from the first place in this order that
sets it (https://slurm.schedmd.com/resource_limits.html): the partition's QOS, the job's QOS
(these two swapped when the job's QOS has the OverPartQOS flag), the user's association (with
what it inherits from its account). So it is not the smallest of them: on the test cluster a
user whose association holds 25 jobs submitted a 28-task array in a QOS whose
MaxSubmitJobsPerUser is 30, and was then refused one job in the default QOS (the association's
25 count every job the user holds). What counts against a cap: for the association's, the jobs
the user holds in that account; for a QOS's, the user's jobs in that QOS (for a partition's
QOS, in the partitions that have it); an array task counts as one job.
"""

from __future__ import annotations

import dataclasses

from hpcrun import slurm
from hpcrun.errors import HpcrunError

# without an accounting storage plugin there are no association or QOS limits
NO_ACCOUNTING = "accounting_storage plugin"
MAX_ARRAY_SIZE = 1001  # SLURM's default, used when the controller is not asked (dry run)
# the QOS SLURM gives a job that names none, when its association names no default and allows
# several (seen: an association allowing capped, normal and wide, no default: `normal`)
FALLBACK_QOS = "normal"
OVER_PART_QOS = "OverPartQOS"


@dataclasses.dataclass(frozen=True)
class SubmitCap:
    """The cap SLURM applies to the sweep's jobs, and how many jobs already count against it."""

    where: str  # e.g. "QOS capped's MaxSubmitJobsPerUser"
    cap: int
    held: int

    @property
    def headroom(self) -> int:
        return max(0, self.cap - self.held)

    def describe(self) -> str:
        return f"{self.where} ({self.cap}; {self.held} held)"


@dataclasses.dataclass(frozen=True)
class Held:
    """One job (an array task) the user holds: pending, running or suspended."""

    account: str
    qos: str
    partitions: tuple[str, ...]  # a pending job may name several


def max_array_size() -> int:
    config = _ask(["scontrol", "show", "config"], "read MaxArraySize")
    return next((int(line.split("=")[1]) for line in config.splitlines() if line.split("=")[0].strip() == "MaxArraySize"), MAX_ARRAY_SIZE)


def submit_cap(account: str | None, qos: str | None, partitions: list[str]) -> SubmitCap | None:
    """The cap on jobs the user may hold that binds first for jobs submitted with `account` and
    `qos` (the site's; None: SLURM's defaults) to `partitions`, or None if none applies. With no
    account named, every association of the user is considered and the tightest taken (jobs go
    to the default account, which is one of them). A SLURM tool that is missing, fails or hangs
    is one line: guessing a cap could submit an array the controller refuses."""
    user = slurm.user()
    where = [f"user={user}", *([f"account={account}"] if account else [])]
    rows = _ask(["sacctmgr", "-n", "-P", "show", "assoc", "where", *where, "format=Account,MaxSubmit,DefaultQOS,QOS"], "read MaxSubmitJobs", NO_ACCOUNTING)
    assocs = [line.split("|") for line in rows.splitlines() if line.count("|") == 3]
    if not assocs:
        return None  # no accounting, or no association the controller would check
    qos_rows = _ask(["sacctmgr", "-n", "-P", "show", "qos", "format=Name,MaxSubmitPU,Flags"], "read MaxSubmitJobsPerUser")
    qos_caps = {name: (int(cap) if cap.isdigit() else None, flags) for name, cap, flags in (line.split("|") for line in qos_rows.splitlines() if line.count("|") == 2)}
    part_qos = _partition_qos()
    held = _held(user)
    caps: list[SubmitCap] = []
    for assoc_account, max_submit, default_qos, allowed in assocs:
        allowed_qos = [q for q in allowed.split(",") if q]
        job_qos = qos or default_qos or (allowed_qos[0] if len(allowed_qos) == 1 else FALLBACK_QOS)
        job_level = (job_qos, f"QOS {job_qos}'s MaxSubmitJobsPerUser", [h for h in held if h.qos == job_qos])
        for partition in partitions:
            levels = [job_level]
            pq = part_qos.get(partition)
            if pq:
                part_level = (pq, f"partition {partition}'s QOS {pq}'s MaxSubmitJobsPerUser", [h for h in held if any(part_qos.get(p) == pq for p in h.partitions)])
                over = OVER_PART_QOS.lower() in qos_caps.get(job_qos, (None, ""))[1].lower()
                levels = [job_level, part_level] if over else [part_level, job_level]
            for name, label, counted in levels:
                cap = qos_caps.get(name, (None, ""))[0]
                if cap is not None:
                    caps.append(SubmitCap(label, cap, len(counted)))
                    break
            else:
                if max_submit.isdigit():
                    counted = [h for h in held if h.account == assoc_account]
                    caps.append(SubmitCap(f"association {user}/{assoc_account}'s MaxSubmitJobs", int(max_submit), len(counted)))
    return min(caps, key=lambda c: c.headroom) if caps else None


def _partition_qos() -> dict[str, str]:
    """Each partition's QOS (`QoS=` in `scontrol show partition`), for those that have one."""
    out = _ask(["scontrol", "show", "partition", "-o"], "read the partitions' QOS")
    found = {}
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("PartitionName") and fields.get("QoS", "N/A") != "N/A":
            found[fields["PartitionName"]] = fields["QoS"]
    return found


def _held(user: str) -> list[Held]:
    out = _ask(["squeue", "-h", "-r", "-u", user, "-o", "%a|%q|%P"], "count the jobs held")
    return [Held(a, q, tuple(p.split(","))) for a, q, p in (line.split("|") for line in out.splitlines() if line.count("|") == 2)]


def _ask(cmd: list[str], why: str, empty_when: str | None = None) -> str:
    out = slurm.run(cmd)
    if out.returncode != 0 and empty_when and empty_when in (out.stderr + out.stdout).lower():
        return ""
    if out.returncode != 0:
        raise HpcrunError(f"{cmd[0]} failed ({why} for the sweep): {out.stderr.strip() or out.stdout.strip() or f'exit status {out.returncode}'}")
    return out.stdout
