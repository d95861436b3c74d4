"""Which submit cap SLURM applies to a sweep (hpcrun.quota), read from SLURM's answers: parsing,
precedence and counting only, with fake tools. The real controller's behaviour (a QOS's cap
before the association's, both ways) is tests/test_cluster_campaign.py's QOS test; partition
QOS and per-account caps are not set up on the test cluster, so their order here rests on
SLURM's documented hierarchy (resource_limits.html) and acct_policy.c."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrun import quota
from hpcrun.errors import HpcrunError
from tests.test_backend_fake import fake_tools

# partition p1 has QOS `part` (4 per user), p2 none
SCONTROL = """case "$*" in
  "show config") echo "MaxArraySize            = 501"; echo "ClusterName             = c1";;
  "-a show partition -o") echo "PartitionName=p1 Nodes=n[1-2] QoS=Part State=UP"; \
echo "PartitionName=p2 Nodes=n3 QoS=N/A State=UP";;
  *) exit 1;;
esac"""
# the user holds four jobs: in p1 (QOS normal), in p2 (QOS capped), pending for either (QOS
# normal), in p2 under another account; another user of the account one in p2 (QOS capped)
# (only with -h -r -a: a header, an unexpanded array or a hidden partition's job left out would
# miscount)
SQUEUE = '''case "$*" in
  "-h -r -a -u me "*) printf "me|acct|normal|p1\\nme|acct|capped|p2\\nme|acct|normal|p2,p1\\nme|other|normal|p2\\n";;
  "-h -r -a -A acct "*) printf "me|acct|normal|p1\\nme|acct|capped|p2\\nme|acct|normal|p2,p1\\nyou|acct|capped|p2\\n";;
  *) exit 1;;
esac'''


def fake_slurm(bindir: Path, capped: str = "10||", assoc: str = "acct||25||normal,capped", qos_exit: int = 0) -> None:
    """`capped`: that QOS's MaxSubmitPU|MaxSubmitPA|Flags; `assoc`: the association's line."""
    qos = f"normal|||\\nCapped|{capped}\\npart|4||\\n"
    fake_tools(bindir, scontrol=SCONTROL, squeue=SQUEUE, sacctmgr=f'''case "$*" in
  "-n -P show assoc where user=me "*"cluster=c1 "*) printf "%b\\n" "{assoc}";;
  "-n -P show qos "*) printf "{qos}"; exit {qos_exit};;
  *) exit 1;;
esac''')


@pytest.fixture
def bindir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{path}:/usr/bin:/bin")
    monkeypatch.setattr("hpcrun.slurm.user", lambda: "me")
    return path


def cap_of(account: str | None, qos: str | None, partitions: list[str]) -> quota.SubmitCap:
    size, cap = quota.limits(account, qos, partitions)
    assert size == 501 and cap is not None
    return cap


def test_the_association_caps_when_no_qos_does(bindir: Path) -> None:
    fake_slurm(bindir)
    cap = cap_of(None, None, ["p2"])
    # the user's jobs in that account: three (not the one under `other`)
    assert (cap.where, cap.cap, cap.held, cap.headroom) == ("association me/acct's MaxSubmitJobs", 25, 3, 22), cap


def test_the_partition_qos_before_the_job_qos(bindir: Path) -> None:
    fake_slurm(bindir)
    # in p1 the partition's QOS caps first, counting the user's jobs that may run in p1
    cap = cap_of(None, "capped", ["p1"])
    assert (cap.where, cap.cap, cap.held) == ("partition p1's QOS part's MaxSubmitJobsPerUser", 4, 2), cap
    # in p2, no partition QOS: the job's QOS (named in any case), counting its jobs and those
    # charged to it through a partition (none here)
    cap = cap_of(None, "CAPPED", ["p2"])
    assert (cap.where, cap.cap, cap.held) == ("QOS capped's MaxSubmitJobsPerUser", 10, 1), cap
    # a sweep over both: the tighter
    assert cap_of(None, "capped", ["p2", "p1"]).headroom == 2


def test_a_job_is_charged_to_its_partitions_qos_too(bindir: Path) -> None:
    # the sweep's QOS is `part` itself: the user's jobs in QOS part (none) and in p1 (two) count
    fake_slurm(bindir)
    cap = cap_of(None, "part", ["p2"])
    assert (cap.where, cap.held) == ("QOS part's MaxSubmitJobsPerUser", 2), cap


def test_over_part_qos_puts_the_job_qos_first(bindir: Path) -> None:
    fake_slurm(bindir, capped="10||DenyOnLimit,OverPartQOS")
    cap = cap_of(None, "capped", ["p1"])
    assert (cap.where, cap.headroom) == ("QOS capped's MaxSubmitJobsPerUser", 9), cap


def test_a_per_account_cap_counts_the_accounts_jobs_and_sets_the_association_aside(bindir: Path) -> None:
    fake_slurm(bindir, capped="|30|")
    cap = cap_of(None, "capped", ["p2"])
    # the account's jobs in QOS capped, every user's: two; the association's 25 no longer applies
    assert (cap.where, cap.cap, cap.held) == ("QOS capped's MaxSubmitJobsPerAccount (acct)", 30, 2), cap


def test_the_default_qos_is_the_associations(bindir: Path) -> None:
    fake_slurm(bindir, assoc="acct||25|capped|capped,normal")
    assert cap_of(None, None, ["p2"]).where == "QOS capped's MaxSubmitJobsPerUser"
    fake_slurm(bindir, assoc="acct||25||capped")  # no default, one QOS allowed: that one
    assert cap_of(None, None, ["p2"]).where == "QOS capped's MaxSubmitJobsPerUser"
    fake_slurm(bindir, assoc="acct||25||capped,normal")  # no default, several: normal (no cap)
    assert cap_of(None, None, ["p2"]).where == "association me/acct's MaxSubmitJobs"


def test_a_partitions_own_association_is_used_there(bindir: Path) -> None:
    fake_slurm(bindir, assoc="acct||25||normal\\nacct|p2|5||normal")
    assert (cap_of(None, None, ["p2"]).cap, cap_of(None, None, ["p3"]).cap) == (5, 25)


def test_no_association_no_cap(bindir: Path) -> None:
    fake_slurm(bindir, assoc="")
    assert quota.limits("acct", None, ["p1"]) == (501, None)


def test_no_accounting_storage_no_cap(bindir: Path) -> None:
    fake_tools(
        bindir,
        scontrol=SCONTROL,
        sacctmgr=(
            'echo "sacctmgr: error: Problem talking to the database: accounting_storage plugin not set" '
            ">&2; exit 1"
        ),
    )
    assert quota.limits(None, None, ["p1"]) == (501, None)


def test_two_accounts_each_with_its_own_rows(bindir: Path) -> None:
    # `other` has its own association for p2 (cap 2, one of the user's jobs in it), `acct` only a
    # general one (cap 3, three jobs): in p2 both count, and acct's is the tighter
    fake_slurm(bindir, assoc="acct||3||normal\\nother|p2|2||normal")
    cap = cap_of(None, None, ["p2"])
    assert (cap.where, cap.held, cap.headroom) == ("association me/acct's MaxSubmitJobs", 3, 0), cap


def test_a_partition_association_counts_its_partitions_jobs(bindir: Path) -> None:
    # acct's own association for p1: the user's acct jobs that may run in p1 (two of three)
    fake_slurm(bindir, assoc="acct||25||normal\\nacct|p3|5||normal")
    fake_tools(bindir, squeue='printf "me|acct|normal|p3\\nme|acct|normal|p1,p3\\nme|acct|normal|p1\\n"')
    cap = cap_of(None, None, ["p3"])
    assert (cap.cap, cap.held) == (5, 2), cap


def test_a_qos_query_that_fails_is_one_error(bindir: Path) -> None:
    fake_slurm(bindir, qos_exit=1)
    with pytest.raises(HpcrunError, match=r"^sacctmgr failed \(read the QOS' submit caps for the sweep\)"):
        quota.limits(None, None, ["p1"])


@pytest.mark.parametrize("tool", ["squeue", "sacctmgr"])
def test_an_answer_that_cannot_be_read_is_one_error(tool: str, bindir: Path) -> None:
    fake_slurm(bindir, assoc="acct|25||normal")  # a field short
    if tool == "squeue":
        fake_slurm(bindir)
        fake_tools(bindir, squeue='echo "me|acct|normal"')  # a field short
    with pytest.raises(HpcrunError, match=f"^{tool} (show assoc )?answered a line this cannot read"):
        quota.limits(None, None, ["p1"])
