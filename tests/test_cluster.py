"""Integration tests on the real SLURM test cluster (tests/cluster/testcluster.sh up).

Skipped with the reason when the cluster is down; `.ci/run` brings it up and sets
HPCRUN_REQUIRE_CLUSTER so that in CI a skip is an error instead.
"""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import pytest

from tests import pool
from tests.runs import hpcrun, recipe, rows, run_dir_of, site_copy, state, status, wait_for

pytestmark = pytest.mark.cluster
RECIPES = ["quickstart", "zero-infinity", "staged", "gpt-strategies", "entrypoint", "command"]


@pytest.fixture
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory both nodes see (the namespaces share the host's filesystem)."""
    return tmp_path_factory.mktemp("cluster")


def wait_state(site: Path, run_dir: Path, wanted: set[str], timeout: float = 180) -> str:
    deadline = time.time() + timeout
    current = ""
    while time.time() < deadline:
        out = hpcrun("status", "--site", str(site), run_dir.name)
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(run_dir.name))
        current = line.split()[2]
        if current in wanted:
            return current
        time.sleep(2)
    raise AssertionError(f"{run_dir.name} still {current}, wanted {wanted}")


@pytest.mark.parametrize("name", RECIPES)
def test_test_only_accepts_every_rendered_script(name: str, tmp_path: Path) -> None:
    note = hpcrun("render", "--site", "testcluster", f"jobs/{name}.yaml").stderr  # "# N runs in this recipe; ..."
    runs = int(note.split()[1]) if "runs in this recipe" in note else 1
    for index in range(runs):
        script = tmp_path / f"{name}-{index}.sh"
        script.write_text(hpcrun("render", "--site", "testcluster", "--index", str(index), f"jobs/{name}.yaml").stdout)
        out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{name}[{index}]: {out.stderr}"
        assert "to start at" in out.stderr


def test_test_only_rejects_an_impossible_script(tmp_path: Path) -> None:
    script = tmp_path / "bad.sh"
    text = hpcrun("render", "--site", "testcluster", "jobs/quickstart.yaml").stdout
    script.write_text(text.replace("#SBATCH --nodes=1", "#SBATCH --nodes=3"))
    out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True)
    assert out.returncode != 0 and "node configuration is not available" in out.stderr


def test_two_node_job_over_the_site_interface(shared: Path) -> None:
    site = site_copy(shared, "testcluster")
    rec = recipe(
        shared,
        "twonode",
        resources={"nodes": 2, "gpus_per_node": 2, "time": "00:10:00"},
        training={"steps": 6, "lr": 0.003},
    )
    out = hpcrun("submit", "--site", str(site), "--wait", str(rec))
    run_dir = run_dir_of(out)
    assert state(run_dir)["status"] == "completed"
    (row,) = rows(shared, run_dir).to_dict("records")
    assert row["world_size"] == 4 and row["nodes"] == 2 and row["node_list"] == pool.node_list()
    # the script SLURM holds for the job is byte for byte what `render` prints for this run id
    job = state(run_dir)["job_id"]
    held = subprocess.run(
        ["scontrol", "write", "batch_script", job, "-"], capture_output=True, text=True, check=True
    ).stdout
    assert held == hpcrun("render", "--site", str(site), "--run-id", run_dir.name, str(rec)).stdout
    status = hpcrun("status", "--site", str(site), run_dir.name)
    assert "COMPLETED" in status.stdout and pool.node_list() in status.stdout and "(from sacct)" in status.stderr
    log = hpcrun("logs", "--site", str(site), run_dir.name, "--rank", "3").stdout
    assert f"[hpcrun] rank 3/4 (local 1) on {pool.nodes()[1]}, job " in log, log


def test_wrong_interface_is_what_breaks(shared: Path) -> None:
    """The site profile's interface really carries the traffic: name another and gloo fails."""
    import yaml

    site = site_copy(shared, "testcluster")
    data = yaml.safe_load(site.read_text())
    data["network"]["interface"] = "eth7"
    site.write_text(yaml.safe_dump(data))
    rec = recipe(
        shared, "wrongif", resources={"nodes": 2, "gpus_per_node": 1, "time": "00:05:00"}, training={"steps": 2}
    )
    out = hpcrun("submit", "--site", str(site), "--wait", str(rec), check=False)
    assert out.returncode == 1
    run_dir = run_dir_of(out)
    errors = "".join(p.read_text() for p in (run_dir / "logs").glob("*_log.err"))
    assert "eth7" in errors


def test_cancel(shared: Path) -> None:
    site = site_copy(shared, "testcluster")
    rec = recipe(shared, "long", training={"steps": 100000, "lr": 0.001}, checkpoint={"interval": 100000})
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    wait_state(site, run_dir, {"RUNNING"})
    assert "cancelled" in hpcrun("cancel", "--site", str(site), run_dir.name).stdout
    assert wait_state(site, run_dir, {"CANCELLED", "COMPLETED", "FAILED"}) == "CANCELLED"


def test_status_wait_ends_when_a_preemption_cancels_the_job(shared: Path) -> None:
    """Where the partition's PreemptMode is CANCEL, a preempted job is over: `status --wait` ends
    there (failed) instead of waiting for a requeue SLURM never makes (before: until --timeout)."""
    site = site_copy(shared, "testcluster")
    rec = recipe(shared, "fragile", training={"steps": 100000, "lr": 0.001}, checkpoint={"interval": 100000},
                 resources={"nodes": 1, "gpus_per_node": 1, "time": "00:10:00", "partition": pool.partition("fragile")})
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    try:
        wait_state(site, run_dir, {"RUNNING"})
        every_cpu = ["-N2", "-n4"]  # of both nodes: it must preempt
        urgent = subprocess.run(
            ["sbatch", "--parsable", "-p", pool.partition("urgent"), *every_cpu, "-o", "/dev/null", "--wrap", "true"],
            capture_output=True, text=True, check=True,
        ).stdout.strip().split(";")[0]
        out = hpcrun("status", "--site", str(site), run_dir.name, "--wait", "--timeout", "120", check=False)
    finally:  # never left holding the pool's nodes
        hpcrun("cancel", "--site", str(site), run_dir.name, check=False)
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)  # failed; 124: still waiting
    assert "PREEMPTED_CANCELLED" in out.stderr, out.stderr  # its progress lines
    # and the job that preempted it runs once the preempted one has left the nodes (KillWait)
    wait_for(lambda: subprocess.run(["sacct", "-X", "-n", "-P", "-j", urgent, "-o", "State"], capture_output=True,
                                    text=True).stdout.split()[:1] == ["COMPLETED"], "the urgent job's end", 120)


def test_refused_partition_shows_sbatch_message(shared: Path) -> None:
    import yaml

    site = site_copy(shared, "testcluster")
    data = yaml.safe_load(site.read_text())
    data["partitions"]["ghost"] = data["partitions"][pool.partition("batch")]
    data["default_partition"] = "ghost"
    site.write_text(yaml.safe_dump(data))
    out = hpcrun("submit", "--site", str(site), "--run-id", "refused-run", "jobs/quickstart.yaml", check=False)
    assert out.returncode == 1
    assert "invalid partition" in out.stderr.lower(), out.stderr
    assert not (shared / "runs" / "refused-run").exists()


def test_zero_infinity_across_two_nodes(shared: Path) -> None:
    """ZeRO-3 with optimizer and parameters offloaded to NVMe on 2 nodes: every rank swaps into
    its node's per-job directory while the job runs (the small model: the tiny one's partitions are under
    DeepSpeed's 1 MiB swap minimum), every step's loss is finite, and the script's trap removes the directory on
    every node at the end."""
    import json

    from tests.runs import STRATEGIES, losses

    nvme = shared / "nvme"
    site = site_copy(
        shared,
        "testcluster",
        storage={
            "runs_dir": str(shared / "runs"),
            "results_dir": str(shared / "results"),
            "nvme": {"path": str(nvme), "size_gb": 5},
        },
    )
    rec = recipe(
        shared,
        "infinity",
        job={"kind": "benchmark", "model": "small"},
        resources={"nodes": 2, "gpus_per_node": 1, "time": "00:15:00"},
        strategy=STRATEGIES["zero3-nvme-offload"],
        training={"steps": 30, "lr": 0.003, "seq_len": 64},
        checkpoint={"interval": 15},
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    swapping: set[str] = set()  # optimizer rank folders seen holding swap files under the job's NVMe directory
    deadline = time.time() + 600
    while time.time() < deadline and status(run_dir) is None:
        swapping |= {p.parent.name for p in nvme.glob("hpcrun-*/**/optimizer/rank*/*.tensor.swp")}
        time.sleep(0.2)
    assert wait_state(site, run_dir, {"COMPLETED", "FAILED"}) == "COMPLETED", state(run_dir)
    assert state(run_dir)["status"] == "completed"
    assert {"rank0", "rank1"} <= swapping, swapping  # both nodes' ranks wrote to NVMe
    job = state(run_dir)["job_id"]
    zero = json.loads((run_dir / "deepspeed-config.json").read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["nvme_path"] == zero["offload_param"]["nvme_path"] == str(nvme / f"hpcrun-{job}")
    assert not list(nvme.glob("hpcrun-*")), list(nvme.iterdir())  # removed on every node
    curve = losses(run_dir)  # the small model's loss moves within noise in 30 steps (tiny's falls: test_runtime.py)
    assert len(curve) == 30 and all(math.isfinite(loss) for loss in curve), curve
