"""What SLURM accepts from this user now: the largest array (MaxArraySize) and how many more jobs
before the controller refuses one (the submit caps). A sweep submits within both, so that no
array is refused halfway through it; the rest is deferred to a later `hpcrun sweep`.

Where a cap comes from: SLURM takes each limit from the first place in this order that sets it
(https://slurm.schedmd.com/resource_limits.html; acct_policy.c): the partition's QOS, the job's
QOS (these two swapped when the job's QOS has the OverPartQOS flag), then the association (with
what it inherits from its account), which is skipped once a QOS sets a per-user or per-account
submit cap. So it is not the smallest of them: on the test cluster a user whose association
holds 25 jobs submitted a 28-task array in a QOS whose MaxSubmitJobsPerUser is 30, and was then
refused one job in the default QOS (the association's 25 count every job of that account).

What counts against a cap: a job is charged to its own QOS and to its partition's QOS (once when
they are the same); a QOS's per-user cap counts the user's jobs charged to it, its per-account
cap the account's (every user's; where PrivateData hides other users' jobs, squeue shows only
the user's and the count is short), the association's cap the user's jobs in that association.
An array task counts as one job. Group caps (GrpSubmitJobs) are not read.
"""

from __future__ import annotations

import dataclasses
import typing as tp

from hpcrun import slurm
from hpcrun.errors import HpcrunError

# sacctmgr's answer when the controller keeps no accounting: no association or QOS caps then
NO_ACCOUNTING_STORAGE = "accounting_storage plugin"
MAX_ARRAY_SIZE = 1001  # SLURM's default, used when the controller is not asked (dry run)
# the QOS SLURM gives a job that names none, when its association names no default and allows
# several (seen: an association allowing capped, normal and wide, no default: `normal`)
FALLBACK_QOS = "normal"


@dataclasses.dataclass(frozen=True)
class SubmitCap:
    """A cap SLURM applies to the sweep's jobs, and how many jobs already count against it."""

    where: str  # e.g. "QOS capped's MaxSubmitJobsPerUser"
    cap: int
    held: int

    @property
    def headroom(self) -> int:
        return max(0, self.cap - self.held)

    def describe(self) -> str:
        return f"{self.where} ({self.cap}; {self.held} held)"


class Assoc(tp.NamedTuple):
    account: str
    partition: str  # "" where the association holds for every partition
    max_submit: int | None
    default_qos: str
    allowed_qos: tuple[str, ...]


class Qos(tp.NamedTuple):
    per_user: int | None  # MaxSubmitJobsPerUser
    per_account: int | None  # MaxSubmitJobsPerAccount
    over_part_qos: bool


class Held(tp.NamedTuple):
    """A job (an array task) held by SLURM: pending, running or suspended."""

    user: str
    account: str
    qos: str
    partitions: tuple[str, ...]  # a pending job may name several


def limits(account: str | None, qos: str | None, partitions: list[str]) -> tuple[int, SubmitCap | None]:
    """(MaxArraySize, the tightest submit cap SLURM applies to jobs submitted with `account` and
    `qos` (the site's; None: SLURM's defaults) to `partitions`, or None if none does). With no
    account named, every association of the user is considered (jobs go to the default account,
    which is one of them). A SLURM tool that is missing, fails or hangs, or answers what this
    cannot read, is one line: guessing a cap could submit an array the controller refuses."""
    config = dict(_pairs(_ask(slurm.show_config(), "read MaxArraySize").splitlines()))
    size = int(config.get("MaxArraySize", MAX_ARRAY_SIZE))
    user = slurm.user()
    assocs = _associations(user, account, config.get("ClusterName"))
    if not assocs:
        return size, None  # no accounting, or no association the controller would check
    caps = _Caps(user, _qos_table(), _partition_qos(), _held(["-u", user]))
    for partition in partitions:
        for assoc in _for_partition(assocs, partition):
            caps.add(assoc, partition, qos)
    return size, min(caps.found, key=lambda c: c.headroom) if caps.found else None


def _for_partition(assocs: list[Assoc], partition: str) -> list[Assoc]:
    """Per account, its association for `partition` if it has one, else its general one."""
    chosen = []
    for account in dict.fromkeys(a.account for a in assocs):
        mine = [a for a in assocs if a.account == account]
        chosen += [a for a in mine if a.partition == partition] or [a for a in mine if not a.partition]
    return chosen


@dataclasses.dataclass
class _Caps:
    """The caps found so far, and what SLURM said to find them with."""

    user: str
    qos_table: dict[str, Qos]
    part_qos: dict[str, str]  # partition -> its QOS
    held: list[Held]  # the user's jobs
    found: list[SubmitCap] = dataclasses.field(default_factory=list)
    account_held: dict[str, list[Held]] = dataclasses.field(
        default_factory=dict
    )  # asked where a per-account cap applies

    def add(self, assoc: Assoc, partition: str, qos: str | None) -> None:
        """The caps on a job of `assoc` in `partition` with QOS `qos` (None: the association's)."""
        job_qos = (
            qos or assoc.default_qos or (assoc.allowed_qos[0] if len(assoc.allowed_qos) == 1 else FALLBACK_QOS)
        ).lower()
        order = [q for q in (self.part_qos.get(partition), job_qos) if q]
        if len(order) == 2 and self.qos_table.get(job_qos, Qos(None, None, False)).over_part_qos:
            order.reverse()
        per_user = self._first(order, "per_user")
        if per_user:
            name, cap = per_user
            self.found.append(
                SubmitCap(self._label(name, partition, "MaxSubmitJobsPerUser"), cap, self._charged(name, self.held))
            )
        per_account = self._first(order, "per_account")
        if per_account:
            name, cap = per_account
            if assoc.account not in self.account_held:
                self.account_held[assoc.account] = _held(["-A", assoc.account])
            held = self._charged(name, self.account_held[assoc.account])
            self.found.append(
                SubmitCap(self._label(name, partition, f"MaxSubmitJobsPerAccount ({assoc.account})"), cap, held)
            )
        if not per_user and not per_account and assoc.max_submit is not None:
            # the jobs of this association: its account, and its partition if it has its own
            held = sum(
                h.account == assoc.account and (not assoc.partition or assoc.partition in h.partitions)
                for h in self.held
            )
            self.found.append(
                SubmitCap(f"association {self.user}/{assoc.account}'s MaxSubmitJobs", assoc.max_submit, held)
            )

    def _first(self, order: list[str], limit: str) -> tuple[str, int] | None:
        """The first QOS in `order` that sets `limit`, with its value: SLURM's precedence."""
        for name in order:
            value = getattr(self.qos_table[name], limit) if name in self.qos_table else None
            if value is not None:
                return name, value
        return None

    def _charged(self, qos: str, held: list[Held]) -> int:
        """How many of `held` SLURM charges to `qos`: their own QOS, or their partition's."""
        return sum(h.qos == qos or any(self.part_qos.get(p) == qos for p in h.partitions) for h in held)

    def _label(self, qos: str, partition: str, limit: str) -> str:
        whose = f"partition {partition}'s QOS {qos}" if self.part_qos.get(partition) == qos else f"QOS {qos}"
        return f"{whose}'s {limit}"


def _associations(user: str, account: str | None, cluster: str | None) -> list[Assoc]:
    where = [f"user={user}", *([f"account={account}"] if account else []), *([f"cluster={cluster}"] if cluster else [])]
    out = _ask(
        slurm.associations(where, "Account,Partition,MaxSubmit,DefaultQOS,QOS"),
        "read MaxSubmitJobs",
        NO_ACCOUNTING_STORAGE,
    )
    return [Assoc(acct, part, _number(cap), dqos.lower(), tuple(q for q in qlist.lower().split(",") if q))
            for acct, part, cap, dqos, qlist in _rows(out, 5, "sacctmgr show assoc")]


def _qos_table() -> dict[str, Qos]:
    out = _ask(
        slurm.qos_caps(),
        "read the QOS' submit caps",
    )
    return {name.lower(): Qos(_number(pu), _number(pa), "overpartqos" in flags.lower().split(","))
            for name, pu, pa, flags in _rows(out, 4, "sacctmgr show qos")}


def _partition_qos() -> dict[str, str]:
    """Each partition's QOS (`QoS=`), for those that have one; hidden partitions too (-a)."""
    out = _ask(slurm.show_partition(), "read the partitions' QOS")
    found = {}
    for line in out.splitlines():
        fields = dict(_pairs(line.split()))  # one partition per line (-o): Key=value fields
        if fields.get("PartitionName") and fields.get("QoS", "N/A") != "N/A":
            found[fields["PartitionName"]] = fields["QoS"].lower()
    return found


def _held(select: list[str]) -> list[Held]:
    out = _ask(slurm.held_jobs(select), "count the jobs held")  # each pending array task counts
    return [Held(u, a, q.lower(), tuple(p.split(","))) for u, a, q, p in _rows(out, 4, "squeue")]


def _rows(out: str, width: int, tool: str) -> list[list[str]]:
    """`|`-separated lines of `width` fields; any other line is refused (a miscount would let a
    sweep past a cap)."""
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    for row in rows:
        if len(row) != width:
            raise HpcrunError(f"{tool} answered a line this cannot read ({width} fields expected): {'|'.join(row)!r}")
    return rows


def _pairs(items: list[str]) -> tp.Iterator[tuple[str, str]]:
    """`Key = value` / `Key=value` items as (key, value)."""
    for line in items:
        key, sep, value = line.partition("=")
        if sep:
            yield key.strip(), value.strip()


def _number(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _ask(cmd: list[str], why: str, empty_when: str | None = None) -> str:
    out = slurm.run(cmd)
    if out.returncode != 0 and empty_when and empty_when in (out.stderr + out.stdout).lower():
        return ""
    if out.returncode != 0:
        raise HpcrunError(
            f"{cmd[0]} failed ({why} for the sweep): "
            f"{slurm.said(out) or f'exit status {out.returncode}'}"
        )
    return out.stdout
