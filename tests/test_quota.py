"""Which job cap SLURM applies to a sweep (hpcrun.quota), read from SLURM's answers: parsing and
precedence only, with fake tools. The real controller's behaviour (a QOS's cap before the
association's, both ways) is tests/test_cluster_campaign.py's QOS test; a partition QOS is not
set up on the test cluster, so its order here rests on SLURM's documented hierarchy."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrun import quota
from tests.test_backend_fake import fake_tools

# partition p1 has QOS `part` (4 per user), p2 none; the user holds three jobs: one in p1 (QOS
# normal), one in p2 (QOS capped), one pending for either (QOS normal), and one in p2 under
# another account (not the association's: its cap does not count it)
SCONTROL = 'echo "PartitionName=p1 Nodes=n[1-2] QoS=part State=UP"; echo "PartitionName=p2 Nodes=n3 QoS=N/A State=UP"'
SQUEUE = 'printf "acct|normal|p1\\nacct|capped|p2\\nacct|normal|p2,p1\\nother|normal|p2\\n"'


def fake_slurm(bindir: Path, capped_flags: str = "", assoc: str = "acct|25||normal,capped") -> None:
    qos = f"normal||\\ncapped|10|{capped_flags}\\npart|4|\\n"
    fake_tools(bindir, scontrol=SCONTROL, squeue=SQUEUE,
               sacctmgr=f'case "$*" in *" assoc "*) echo "{assoc}";; *" qos "*) printf "{qos}";; *) exit 1;; esac')


@pytest.fixture
def bindir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{path}:/usr/bin:/bin")
    return path


def test_the_association_caps_when_no_qos_does(bindir: Path) -> None:
    fake_slurm(bindir)
    cap = quota.submit_cap(None, None, ["p2"])
    assert cap is not None and cap.where.endswith("/acct's MaxSubmitJobs") and (cap.cap, cap.held, cap.headroom) == (25, 3, 22), cap


def test_the_partition_qos_before_the_job_qos(bindir: Path) -> None:
    fake_slurm(bindir)
    # in p1 the partition's QOS caps first, counting the jobs that may run in p1 (two of three)
    cap = quota.submit_cap(None, "capped", ["p1"])
    assert cap is not None and (cap.where, cap.cap, cap.held) == ("partition p1's QOS part's MaxSubmitJobsPerUser", 4, 2), cap
    # in p2, no partition QOS: the job's QOS, counting only its own jobs
    cap = quota.submit_cap(None, "capped", ["p2"])
    assert cap is not None and (cap.where, cap.cap, cap.held) == ("QOS capped's MaxSubmitJobsPerUser", 10, 1), cap
    # a sweep over both: the tighter
    cap = quota.submit_cap(None, "capped", ["p1", "p2"])
    assert cap is not None and cap.headroom == 2, cap


def test_over_part_qos_puts_the_job_qos_first(bindir: Path) -> None:
    fake_slurm(bindir, capped_flags="DenyOnLimit,OverPartQOS")
    cap = quota.submit_cap(None, "capped", ["p1"])
    assert cap is not None and (cap.where, cap.headroom) == ("QOS capped's MaxSubmitJobsPerUser", 9), cap


def test_the_default_qos_is_the_associations(bindir: Path) -> None:
    fake_slurm(bindir, assoc="acct|25|capped|normal,capped")
    cap = quota.submit_cap(None, None, ["p2"])
    assert cap is not None and cap.where == "QOS capped's MaxSubmitJobsPerUser", cap
    fake_slurm(bindir, assoc="acct|25||capped")  # no default, one QOS allowed: that one
    cap = quota.submit_cap(None, None, ["p2"])
    assert cap is not None and cap.where == "QOS capped's MaxSubmitJobsPerUser", cap


def test_no_association_no_cap(bindir: Path) -> None:
    fake_slurm(bindir, assoc="")
    assert quota.submit_cap("acct", None, ["p1"]) is None
