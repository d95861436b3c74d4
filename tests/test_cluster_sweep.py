"""Sweeps and stages on the real SLURM test cluster."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.runs import hpcrun, losses, site_copy, state, status

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def wait_all(run_dirs: list[Path], timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(status(d) in ("completed", "failed") for d in run_dirs):
            return
        time.sleep(2)
    raise AssertionError(
        "sweep did not finish: " + ", ".join(f"{d.name}={(d / 'state.json').exists()}" for d in run_dirs)
    )


def test_sweep_runs_as_throttled_arrays_and_is_idempotent(tmp_path: Path) -> None:
    site = site_copy(tmp_path, "testcluster")
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "grid", "job": {"kind": "benchmark", "model": "tiny"},
        "resources": {"gpus_per_node": 1, "time": "00:10:00"}, "training": {"steps": 6},
        "sweep": {"axes": {"strategy": ["ddp", {"name": "fsdp"}], "resources.nodes": [1, 2, 3]}, "max_concurrent": 1},
    }))
    out = hpcrun("sweep", "--site", str(site), str(recipe)).stdout
    assert "submitted 4 point(s)" in out and out.count("  array 0-1%1:") == 2
    assert out.count("skipped") == 2 and "must be <= 2" in out  # 3 nodes cannot run here
    sweep_dir = next((tmp_path / "runs" / "sweeps").iterdir())
    ledger = json.loads((sweep_dir / "ledger.json").read_text())["points"]
    jobs = {e["job_id"].split("_")[0] for e in ledger.values() if "job_id" in e}
    assert len(jobs) == 2
    run_dirs = [tmp_path / "runs" / e["run_id"] for e in ledger.values() if "run_id" in e]
    # the concurrency limit is SLURM's own: at most one task of each array runs at a time
    for job in jobs:
        tasks = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        assert "ArrayTaskThrottle=1" in tasks
    wait_all(run_dirs)
    assert all(state(d)["status"] == "completed" for d in run_dirs)
    again = hpcrun("sweep", "--site", str(site), str(recipe)).stdout
    assert "submitted 0 point(s); 4 already submitted" in again
    table = hpcrun(
        "results",
        "--dir",
        str(tmp_path / "results"),
        "--sweep",
        sweep_dir.name,
        "--compare",
        "strategy,nodes",
        "--format",
        "csv",
    ).stdout
    assert len(table.strip().splitlines()) == 5 and "scaling_efficiency" in table.splitlines()[0]
    # state.json says completed before the batch script has ended (it still clears node-local
    # snapshots): SLURM's word is awaited before the counts
    hpcrun("status", "--site", str(site), sweep_dir.name, "--wait", "--timeout", "120")
    status = hpcrun("status", "--site", str(site), sweep_dir.name).stdout
    assert "done 4  running 0  pending 0  failed 0" in status


def test_two_stages_hand_weights_from_ddp_to_fsdp(tmp_path: Path) -> None:
    site = site_copy(tmp_path, "testcluster")
    recipe = tmp_path / "staged.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "staged", "job": {"kind": "benchmark", "model": "tiny"},
        "resources": {"nodes": 1, "gpus_per_node": 2, "time": "00:10:00"}, "training": {"steps": 8, "lr": 0.003},
        "stages": [{"name": "warmup", "strategy": {"name": "ddp"}}, {"name": "main", "strategy": {"name": "fsdp"}}],
    }))
    out = hpcrun("submit", "--site", str(site), str(recipe)).stdout
    run_dirs = [Path(line.split("run dir:")[1].strip()) for line in out.splitlines() if "run dir:" in line]
    assert [d.name.split(".")[-1] for d in run_dirs] == ["warmup", "main"]
    first_job, second_job = (json.loads((d / "jobs.json").read_text())[0]["job_id"] for d in run_dirs)
    # asked right after submission: the first stage is still starting Python (tens of seconds of
    # work), so the second one waits on it
    deps = subprocess.run(["scontrol", "show", "job", second_job], capture_output=True, text=True, check=True).stdout
    assert f"Dependency=afterok:{first_job}(unfulfilled)" in deps and "JobState=PENDING" in deps, deps
    wait_all(run_dirs)
    first, second = losses(run_dirs[0]), losses(run_dirs[1])
    assert state(run_dirs[1])["status"] == "completed"
    assert second[0] < first[0] - 0.05  # it started from the trained weights, not a fresh init
    assert second[0] < first[-1] + 0.05  # ... and is no worse than where the first stage ended
    log = "".join(p.read_text() for p in (run_dirs[1] / "logs").glob("*_0_log.out"))
    assert "initialised from" in log and "final-weights.pt" in log
