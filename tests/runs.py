"""Running real jobs from tests: a private copy of a site (runs under tmp), submit, wait, read."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import yaml

from hpcrun.results import load
from tests import pool
from tests.helpers import ROOT

STRATEGIES: dict[str, dict[str, tp.Any]] = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp", "sharding": "full"},
    "zero1": {"name": "deepspeed", "stage": 1},
    "zero2": {"name": "deepspeed", "stage": 2},
    "zero3": {"name": "deepspeed", "stage": 3},
    "zero3-cpu-offload": {"name": "deepspeed", "stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "zero3-nvme-offload": {"name": "deepspeed", "stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
}


# a site's environment whose container has no SLURM clients (tests/cluster/noslurm/apptainer), as many have none
NO_SLURM_CONTAINER = {
    "setup": [f"export PATH={ROOT / 'tests' / 'cluster' / 'noslurm'}:$PATH"],
    "container": {"runtime": "apptainer", "image": "/images/without-slurm.sif"},
    "python": sys.executable,
}


def site_copy(tmp: Path, base: str = "local", **changes: tp.Any) -> Path:
    """`sites/<base>.yaml` with runs and results under `tmp` (and any top-level changes)."""
    data = yaml.safe_load((ROOT / "sites" / f"{base}.yaml").read_text())
    data["name"] = f"{base}-test"
    data["storage"]["runs_dir"] = str(tmp / "runs")
    data["storage"]["results_dir"] = str(tmp / "results")
    if base == "local":
        data["partitions"]["local"]["cpu_peak_tflops_per_rank"] = 0.05
    if base == "testcluster":  # this test process's pool of the cluster (tests/pool.py)
        data["partitions"] = {pool.partition(name): value for name, value in data["partitions"].items()}
        data["default_partition"] = pool.partition(data["default_partition"])
    for key, value in changes.items():
        data[key] = value
    path = tmp / f"{data['name']}.yaml"
    # whole or not at all: pytest processes sharing a directory (baselines) write the same copy
    # while another's `hpcrun submit` reads it
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(yaml.safe_dump(data))
    os.replace(partial, path)
    return path


def scale_site(tmp: Path, **changes: tp.Any) -> Path:
    """The test cluster's `scale` partition (its upper half: the scale tests', run beside the others)."""
    return site_copy(tmp, "testcluster", default_partition="scale", partitions={
        "scale": {"max_nodes": 4, "gpus_per_node": 0, "cpus_per_node": 2, "memory_gb": 3.9, "max_time": "01:00:00"},
    }, **changes)


def recipe(tmp: Path, name: str, **fields: tp.Any) -> Path:
    data = {
        "name": name,
        "job": {"kind": "benchmark", "model": "tiny"},
        "resources": {"nodes": 1, "gpus_per_node": 2, "time": "00:10:00"},
    }
    data.update(fields)
    # no warm standby unless a test asks for it (tests/test_cluster_in_job.py, test_cluster_shrink.py): on CI's
    # 2 cores each would import torch beside every attempt of every cluster test (~10 s of a core each)
    data["fault"] = {"warm_standby": False, **(data.get("fault") or {})}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def hpcrun(
    *args: str, cwd: Path | None = None, timeout: int = 600, check: bool = True
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", *args], capture_output=True, text=True, cwd=cwd or ROOT, timeout=timeout
    )
    if check and out.returncode != 0:
        raise AssertionError(f"hpcrun {' '.join(args)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def run_dir_of(out: subprocess.CompletedProcess[str]) -> Path:
    for line in out.stdout.splitlines():
        if line.strip().startswith("run dir:"):
            return Path(line.split("run dir:")[1].strip())
    raise AssertionError(f"no run dir in output:\n{out.stdout}")


def losses(run_dir: Path) -> list[float]:
    """Every step's global loss across the run's attempts, in step order."""
    files = sorted(run_dir.glob("losses-*.txt"), key=lambda p: p.stat().st_mtime)
    return [float(x) for x in files[-1].read_text().split()] if files else []


def state(run_dir: Path) -> dict[str, tp.Any]:
    return dict(json.loads((run_dir / "state.json").read_text()))


def status(run_dir: Path) -> str | None:
    """The attempt's recorded end (stopped, requeued, completed, failed), or None while it runs:
    state.json can exist before that, holding a running attempt's slow ranks or lost nodes."""
    return state(run_dir).get("status") if (run_dir / "state.json").exists() else None


def rows(tmp: Path, run_dir: Path) -> tp.Any:
    return load(tmp / "results", run_id=run_dir.name)


def wait_for(
    predicate: tp.Callable[[], bool], what: str, timeout: float = 240, detail: tp.Callable[[], str] | None = None
) -> None:
    """Poll `predicate` until it holds; a timeout names what was awaited (and `detail()`: what was seen)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        # a quarter second: predicates run pgrep or read Parquet, and twenty looks a second were CPU
        # taken from the jobs under test on CI's two cores; no test needs a faster reaction
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}" + (f": {detail()}" if detail else ""))


def session_dir(tmp_path_factory: tp.Any, name: str) -> Path:
    """A directory of this test session that its pytest-xdist workers share (made)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    shared.mkdir(parents=True, exist_ok=True)
    return tp.cast(Path, shared)


def local_baseline(tmp_path_factory: tp.Any, world: int, **fields: tp.Any) -> Path:
    """An uninterrupted run of a cluster test's training on this machine (`--site local`, one
    node, `world` CPU ranks): same world size, same numbers, so its weights are what an
    interrupted cluster run must end with. Submitted detached, once per test session and recipe:
    pytest-xdist workers share it through the session's directory (a lock, a fixed run id), and
    it trains while the cluster jobs run (HPCRUN_TEST_BASELINES: shared by pytest processes too).
    `baseline_weights` waits for it."""
    from filelock import FileLock

    from tests.delayed_training import entrypoint_job

    # HPCRUN_TEST_BASELINES: a directory pytest processes running at once share (.ci/run)
    shared = Path(os.environ.get("HPCRUN_TEST_BASELINES") or session_dir(tmp_path_factory, "baselines"))
    shared.mkdir(parents=True, exist_ok=True)
    fields = {
        "job": entrypoint_job(str(ROOT), 0.0),
        **fields,
        "resources": {"nodes": 1, "gpus_per_node": world, "time": "00:10:00"},
    }
    # torch's version in the id: a pytest run on another torch (CI's oldest) trains its own
    named = json.dumps({**fields, "torch": importlib.metadata.version("torch")}, sort_keys=True)
    run_id = f"baseline-{world}-{hashlib.sha1(named.encode()).hexdigest()[:10]}"
    # a larger world's site apart (more CPUs): pytest processes share the 4-rank one as it is
    where = shared if world <= 4 else shared / f"world-{world}"
    where.mkdir(exist_ok=True)
    with FileLock(shared / f"{run_id}.lock"):
        run_dir = where / "runs" / run_id
        if not run_dir.exists():
            partition = {
                "max_nodes": 1,
                "gpus_per_node": 0,
                "cpus_per_node": max(4, world),
                "memory_gb": 16,
                "max_time": "1-00:00:00",
            }
            local = site_copy(where, partitions={"local": partition})
            hpcrun("submit", "--site", str(local), "--run-id", run_id, str(recipe(shared, run_id, **fields)))
    return run_dir


def baseline_weights(run_dir: Path) -> str:
    # any recorded end: a baseline stopped at its time limit is a failure to show, not to wait out
    wait_for(lambda: status(run_dir) is not None, what=f"the baseline {run_dir.name}", timeout=600,
             detail=lambda: log_tails(run_dir))
    assert state(run_dir)["status"] == "completed", (state(run_dir), log_tails(run_dir))
    return (run_dir / "weights.sha256").read_text()


def log_tails(run_dir: Path, lines: int = 12) -> str:
    """The last lines of each log of a local run (its controller's, each rank's), for a failure's message."""
    tails = []
    for log in sorted((run_dir / "logs").glob("*")):
        if log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(tails) or f"no logs in {run_dir}"
