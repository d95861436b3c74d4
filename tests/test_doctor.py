"""`hpcrun doctor` end to end: on the local site, on the real test cluster, and on a copy of
the test site with a wrong interface, which must be caught with a clear finding."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hpcrun.results import load
from tests import pool
from tests.runs import hpcrun, site_copy


@pytest.mark.slow
def test_doctor_local(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    out = hpcrun("doctor", "--site", str(site))
    lines = out.stdout.splitlines()
    assert any(ln.startswith("ok    ranks: 2 ranks") for ln in lines), out.stdout
    assert any(ln.startswith("ok    all-reduce: gloo bus bandwidth") for ln in lines)
    assert not any(ln.startswith("fail") for ln in lines)
    row = load(tmp_path / "results", job_kind="doctor").iloc[0]
    assert dict(row["extra"])["busbw_gbs_peak"] > 0


@pytest.mark.cluster
def test_doctor_on_the_cluster(tmp_path: Path) -> None:
    site = site_copy(tmp_path, "testcluster")
    out = hpcrun("doctor", "--site", str(site), "--nodes", "2")
    lines = out.stdout.splitlines()
    assert any(ln.startswith(f"ok    partition {pool.partition('batch')}: 2 nodes, 2 CPUs") for ln in lines), out.stdout
    assert any(ln.startswith("ok    sbatch --test-only") for ln in lines)
    assert any(ln.startswith(f"ok    ranks: 4 ranks on {', '.join(pool.nodes())} over hpc0") for ln in lines), (
        out.stdout
    )
    assert any("warn  bandwidth: no nominal figure" in ln for ln in lines)


@pytest.mark.cluster
def test_doctor_catches_a_wrong_interface(tmp_path: Path) -> None:
    site = site_copy(tmp_path, "testcluster")
    data = yaml.safe_load(site.read_text())
    data["network"]["interface"] = "eth7"
    site.write_text(yaml.safe_dump(data))
    out = hpcrun("doctor", "--site", str(site), "--nodes", "2", check=False)
    assert out.returncode == 1
    assert f"fail  rank 0 on {pool.nodes()[0]}: interface 'eth7' has no address there (it has lo, hpc0)" in out.stdout
    assert f"set network.interface in {site}" in out.stdout


@pytest.mark.cluster
def test_doctor_catches_a_wrong_partition_size(tmp_path: Path) -> None:
    site = site_copy(tmp_path, "testcluster")
    data = yaml.safe_load(site.read_text())
    batch = pool.partition("batch")
    data["partitions"][batch]["cpus_per_node"] = 64
    site.write_text(yaml.safe_dump(data))
    out = hpcrun("doctor", "--site", str(site), "--login-only", check=False)
    assert out.returncode == 1
    assert (
        f"fail  partition {batch}: cpus_per_node 64 but nodes have 2 -> set partitions.{batch}.cpus_per_node: 2"
        in out.stdout
    )
