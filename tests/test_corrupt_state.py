"""Corrupt state on disk stops `hpcrun sweep` with one line naming the file, exit code 2, and
nothing submitted: with sbatch faked (fast), and on the real test cluster counted with sacct."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import typing as tp
import uuid
from pathlib import Path

import pytest
import yaml

from hpcrun.campaign import points
from hpcrun.recipe import load_recipe
from hpcrun.rundir import RunDir, sweep_dir
from hpcrun.site import load_site
from hpcrun.sweep import sweep_id
from tests.helpers import ROOT
from tests.runs import site_copy
from tests.test_backend_fake import fake_tools
from tests.test_sweep import FAKE_SBATCH

GARBAGE = '{"points": {"abc": {"job_id": "1"'  # a write cut short


def sweep(site: Path, recipe: Path, env: dict[str, str] | None = None, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hpcrun", "sweep", "--site", str(site), str(recipe), *extra]
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def refused(out: subprocess.CompletedProcess[str], path: Path) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith(f"Error: {path}: corrupt state file, refusing to guess its content"), out.stderr


def layout(site: Path, recipe: Path) -> tuple[Path, list[tuple[str, RunDir]]]:
    """The sweep's directory and its runnable points (id, run directory), as hpcrun plans them."""
    loaded_site, recipe_file = load_site(str(site)), load_recipe(recipe)
    sid = sweep_id(recipe_file, loaded_site)
    runnable = [(p.point_id, RunDir(p.spec.run_dir)) for p in points(loaded_site, recipe_file, sid) if p.spec]
    return sweep_dir(loaded_site.storage.runs_dir, sid), runnable


# --- fast: sbatch and friends faked at the process boundary -------------------------------------
@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    fake_tools(
        bindir,
        sbatch=FAKE_SBATCH,
        srun="exit 0",
        scontrol='echo "MaxArraySize            = 1001"',
        sacctmgr="exit 0",
        squeue="exit 0",
        sacct="exit 0",
    )
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path)}


def submitted(tmp_path: Path) -> int:
    path = tmp_path / "submitted"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("content", [GARBAGE, "[]", '{"points": ["p1"]}'], ids=["cut-short", "a-list", "points-a-list"])
def test_corrupt_ledger_submits_nothing(content: str, fake_env: dict[str, str], tmp_path: Path) -> None:
    site = site_copy(tmp_path, "testcluster")
    recipe = ROOT / "jobs" / "gpt-strategies.yaml"
    directory, _ = layout(site, recipe)
    directory.mkdir(parents=True)
    (directory / "ledger.json").write_text(content)
    refused(sweep(site, recipe, fake_env), directory / "ledger.json")
    assert submitted(tmp_path) == 0
    assert (directory / "ledger.json").read_text() == content  # left as it was, for inspection


def test_corrupt_jobs_file_of_a_point_submits_nothing(fake_env: dict[str, str], tmp_path: Path) -> None:
    site = site_copy(tmp_path, "testcluster")
    recipe = ROOT / "jobs" / "gpt-strategies.yaml"
    first = sweep(site, recipe, fake_env)
    assert first.returncode == 0 and submitted(tmp_path) == 8, first.stdout + first.stderr
    directory, runnable = layout(site, recipe)
    # one point is lost from the ledger (so it is due again); another point's jobs file is cut short
    ledger = json.loads((directory / "ledger.json").read_text())
    lost_point, _ = runnable[0]
    del ledger["points"][lost_point]
    (directory / "ledger.json").write_text(json.dumps(ledger))
    _, broken = runnable[-1]
    broken.jobs_file.write_text('[{"job_id": "101_3", "sched')
    for extra in ([], ["--retry-failed"]):
        refused(sweep(site, recipe, fake_env, *extra), broken.jobs_file)
        assert submitted(tmp_path) == 8  # nothing more went out


def test_corrupt_state_file_of_a_point_submits_nothing(fake_env: dict[str, str], tmp_path: Path) -> None:
    site = site_copy(tmp_path, "testcluster")
    recipe = ROOT / "jobs" / "gpt-strategies.yaml"
    _, runnable = layout(site, recipe)
    _, broken = runnable[2]
    broken.path.mkdir(parents=True)
    broken.state_file.write_text("\x00\x00\x00")
    refused(sweep(site, recipe, fake_env), broken.state_file)
    assert submitted(tmp_path) == 0


# --- the real cluster: jobs counted with sacct before and after ---------------------------------
def cluster_jobs(name: str) -> int:
    """Jobs of this name the cluster knows: sacct (every state) and squeue (in case accounting
    has not caught up with a submission yet)."""
    time.sleep(3)
    acct = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-S", "2020-01-01", "--name", name, "-o", "JobID"],
        capture_output=True,
        text=True,
        check=True,
    )
    queue = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True, check=True)
    return max(len(acct.stdout.split()), len(queue.stdout.split()))


@pytest.fixture
def cluster_sweep(tmp_path: Path) -> tp.Iterator[tuple[Path, Path, str]]:
    name = f"corrupt-{uuid.uuid4().hex[:8]}"
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": name, "job": {"kind": "benchmark", "model": "tiny"},
        "resources": {"nodes": 1, "gpus_per_node": 1, "time": "00:02:00"}, "training": {"steps": 2},
        "sweep": {"axes": {"strategy": ["ddp", {"name": "fsdp"}]}},
    }))
    yield site_copy(tmp_path, "testcluster"), recipe, name
    subprocess.run(["scancel", "-n", name], check=False, capture_output=True)  # whatever a failed run of this test sent



@pytest.mark.cluster
def test_corrupt_ledger_on_the_cluster(cluster_sweep: tuple[Path, Path, str]) -> None:
    site, recipe, name = cluster_sweep
    directory, _ = layout(site, recipe)
    directory.mkdir(parents=True)
    (directory / "ledger.json").write_text(GARBAGE)
    before = cluster_jobs(name)
    refused(sweep(site, recipe), directory / "ledger.json")
    assert cluster_jobs(name) == before == 0


@pytest.mark.cluster
def test_corrupt_jobs_file_on_the_cluster(cluster_sweep: tuple[Path, Path, str]) -> None:
    """One point is recorded as submitted, but its run's jobs file is cut short; the other point
    is due. Nothing may go out: the sweep's state is not what it seems."""
    site, recipe, name = cluster_sweep
    directory, runnable = layout(site, recipe)
    (recorded, broken), _ = runnable
    directory.mkdir(parents=True)
    (directory / "ledger.json").write_text(
        json.dumps({"points": {recorded: {"job_id": "999999", "run_id": broken.name, "state": "submitted"}}})
    )
    broken.path.mkdir(parents=True)
    broken.jobs_file.write_text('[{"job_id": "999999", "sched')
    before = cluster_jobs(name)
    refused(sweep(site, recipe), broken.jobs_file)
    assert cluster_jobs(name) == before == 0
