"""Sweeps: expansion, include/exclude, skip reasons, array splitting, the ledger, and ten
concurrent `hpcrun sweep` invocations (sbatch faked at the process boundary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpcrun.campaign import arrays, points
from hpcrun.ledger import Ledger
from hpcrun.recipe import Sweep, load_recipe
from hpcrun.site import load_site
from hpcrun.sweep import expand, point_id
from tests.helpers import ROOT
from tests.runs import site_copy
from tests.test_backend_fake import fake_tools


def test_expand_matrix_include_exclude() -> None:
    sweep = Sweep.model_validate({
        "axes": {"strategy": ["ddp", "fsdp"], "resources.nodes": [1, 2]},
        "exclude": [{"strategy": {"name": "fsdp"}, "resources.nodes": 1}],
        "include": [{"strategy": "ddp", "resources.nodes": 4}, {"strategy": "ddp", "resources.nodes": 1}],
    })
    got = expand(sweep)
    assert got == [
        {"strategy": "ddp", "resources.nodes": 1},
        {"strategy": "ddp", "resources.nodes": 2},
        {"strategy": "fsdp", "resources.nodes": 2},
        {"strategy": "ddp", "resources.nodes": 4},
    ]
    assert len({point_id(p) for p in got}) == 4
    assert point_id({"a": 1, "b": 2}) == point_id({"b": 2, "a": 1})


def test_points_that_cannot_run_are_skipped_with_reason(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "resources": {"gpus_per_node": 2},
                "sweep": {
                    "axes": {
                        "resources.nodes": [1, 3],
                        "strategy": ["ddp", {"name": "deepspeed", "stage": 3, "offload_param": "nvme"}],
                    }
                },
            }
        )
    )
    pts = points(load_site("slingshot"), load_recipe(recipe), "sid")
    reasons = {p.label: p.skipped for p in pts}
    assert reasons["resources.nodes=1 strategy=ddp"] is None
    assert (
        "nvme offload needs storage.nvme"
        in reasons["resources.nodes=1 strategy=name=deepspeed,offload_param=nvme,stage=3"]
    )
    assert all(p.spec is not None for p in pts if p.skipped is None)
    pts = points(load_site("testcluster"), load_recipe(recipe), "sid")
    assert "must be <= 2" in {p.label: p.skipped for p in pts}["resources.nodes=3 strategy=ddp"]


def test_planner_skips_points_that_do_not_fit(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "big",
                "job": {"kind": "benchmark", "model": "13b"},
                "precision": "bf16-mixed",
                "resources": {"gpus_per_node": 8, "time": "01:00:00"},
                "training": {"micro_batch": 1, "seq_len": 2048, "activation_checkpointing": True},
                "sweep": {"axes": {"strategy": ["ddp", {"name": "deepspeed", "stage": 3}]}},
            }
        )
    )
    reasons = {p.label: p.skipped for p in points(load_site("mycluster"), load_recipe(recipe), "sid")}
    assert reasons["strategy=ddp"] == "planner: ddp needs 234.3 GB per GPU, has 80", reasons
    assert reasons["strategy=name=deepspeed,stage=3"] is None


def test_arrays_group_by_shape_and_split() -> None:
    recipe = load_recipe(ROOT / "jobs" / "gpt-strategies.yaml")
    specs = [p.spec for p in points(load_site("testcluster"), recipe, "sid") if p.spec]
    chunks, deferred = arrays(specs, max_array_size=3, headroom=None)
    assert [len(c) for c in chunks] == [3, 1, 3, 1] and not deferred
    assert all(len({s.nodes for s in c}) == 1 for c in chunks)
    chunks, deferred = arrays(specs, max_array_size=1001, headroom=5)
    assert [len(c) for c in chunks] == [4, 1] and len(deferred) == 3


def test_ledger_merges_records(tmp_path: Path) -> None:
    with Ledger.locked(tmp_path) as ledger:
        ledger.record("p1", state="skipped", reason="x")
        ledger.save()
    with Ledger.locked(tmp_path) as ledger:
        ledger.record("p1", state="submitted", job_id="7")
        ledger.record("p2", state="submitted", job_id="8")
        ledger.save()
    assert Ledger.read(tmp_path) == {
        "p1": {"state": "submitted", "reason": "x", "job_id": "7"},
        "p2": {"state": "submitted", "job_id": "8"},
    }


FAKE_SBATCH = """
set -e
script="${@: -1}"
n=$(grep -oP '(?<=--array=0-)[0-9]+' "$script" || echo 0)
exec 9>>"$FAKE_DIR/lock"; flock 9
id=$(( $(cat "$FAKE_DIR/next" 2>/dev/null || echo 100) + 1 )); echo $id >"$FAKE_DIR/next"
for i in $(seq 0 $n); do echo "$id $(grep -c '' "$script")" >>"$FAKE_DIR/submitted"; done
echo "$id"
"""


def test_ten_concurrent_sweeps_submit_each_point_once(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    fake_tools(
        bindir, sbatch=FAKE_SBATCH, srun="exit 0",
        scontrol='echo "MaxArraySize            = 1001"', sacctmgr="exit 0", squeue="exit 0",
        sacct='exit 0',
    )
    site = site_copy(tmp_path, "testcluster")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "hpcrun.cli", "sweep", "--site", str(site), "jobs/gpt-strategies.yaml"]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(10)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    submitted = (tmp_path / "submitted").read_text().splitlines()
    assert len(submitted) == 8  # 4 strategies x 2 node counts, each exactly once
    assert len({line.split()[0] for line in submitted}) == 2  # as two arrays (one per shape)
    assert sum("submitted 8 point(s)" in o for o, _ in outs) == 1
    assert sum("submitted 0 point(s); 8 already submitted" in o for o, _ in outs) == 9
    sweep_dir = next((tmp_path / "runs" / "sweeps").iterdir())
    ledger = json.loads((sweep_dir / "ledger.json").read_text())["points"]
    assert sorted(e["job_id"].split("_")[1] for e in ledger.values()) == ["0", "0", "1", "1", "2", "2", "3", "3"]
    run_dirs = [tmp_path / "runs" / e["run_id"] for e in ledger.values()]
    assert all((d / "script.sh").read_text().count("#SBATCH --array=0-3%4") == 1 for d in run_dirs)


@pytest.mark.parametrize("ended", ["FAILED", "DEADLINE"])
def test_retry_failed_resubmits_only_failed_points(ended: str, tmp_path: Path) -> None:
    """Only the point that ended without completing (any such state: hpcrun.jobstate) goes again;
    a SUSPENDED one has not ended."""
    bindir = tmp_path / "bin"
    fake_tools(
        bindir,
        sbatch=FAKE_SBATCH,
        srun="exit 0",
        scontrol='echo "MaxArraySize            = 1001"',
        sacctmgr="exit 0",
        squeue="exit 0",
        # the first array's task 1 ended badly, its task 2 is suspended, everything else completed
        sacct=(
            f'for j in $(echo "$@" | grep -oP "(?<=-j )\\S+" | tr , " "); do s=COMPLETED; '
            f'[ "$j" = 101_1 ] && s={ended}; '
            '[ "$j" = 101_2 ] && s=SUSPENDED; echo "$j|$s|node1|5|None"; done'
        ),
    )
    site = site_copy(tmp_path, "testcluster")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "hpcrun.cli", "sweep", "--site", str(site), "jobs/gpt-strategies.yaml"]
    first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert "submitted 8 point(s)" in first.stdout, first.stderr
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert "submitted 0 point(s)" in again.stdout
    retry = subprocess.run(cmd + ["--retry-failed"], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert "submitted 1 point(s); 7 already submitted" in retry.stdout, retry.stdout + retry.stderr
    assert len((tmp_path / "submitted").read_text().splitlines()) == 9


def test_resuming_a_point_sends_its_own_script_and_the_sweep_adopts_its_job(tmp_path: Path) -> None:
    """`hpcrun resume` of one sweep point submits a script of its own (its array's would start
    every point again), and the next `hpcrun sweep` records that job for the point, whose array's
    answer was lost, instead of submitting it a second time."""
    bindir = tmp_path / "bin"
    sbatch = FAKE_SBATCH + 'cp "$script" "$FAKE_DIR/script-$id"\n'
    lost_first = 'if [ ! -e "$FAKE_DIR/once" ]; then touch "$FAKE_DIR/once"; exec >/dev/null; fi\n'  # no answer
    fake_tools(bindir, sbatch=lost_first + sbatch, srun="exit 0", scontrol='echo "MaxArraySize            = 1001"',
               sacctmgr="exit 0", squeue="exit 0", sacct="exit 0")
    site = site_copy(tmp_path, "testcluster")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path)}

    def hpcrun(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hpcrun.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True
        )

    first = hpcrun("sweep", "--site", str(site), "jobs/gpt-strategies.yaml")
    assert first.returncode == 2 and "SLURM shows no job" in first.stderr, first  # the array's answer is lost
    ledger = json.loads(next((tmp_path / "runs" / "sweeps").glob("*/ledger.json")).read_text())
    point, entry = next(iter(ledger["points"].items()))
    assert entry["state"] == "submitting"
    for intent in (tmp_path / "runs").glob("*/submitting.json"):  # past the wait for a late answer
        intent.write_text(json.dumps({**json.loads(intent.read_text()), "at": time.time() - 600}))
    resumed = hpcrun("resume", "--site", str(site), entry["run_id"])
    assert resumed.returncode == 0, resumed
    job = resumed.stdout.split("as job ")[1].strip()
    script = (tmp_path / f"script-{job}").read_text()
    assert "#SBATCH --array" not in script and f"#SBATCH --comment=hpcrun:{entry['run_id']}" in script
    again = hpcrun("sweep", "--site", str(site), "jobs/gpt-strategies.yaml")
    ledger = json.loads(next((tmp_path / "runs" / "sweeps").glob("*/ledger.json")).read_text())
    assert ledger["points"][point]["job_id"] == job and ledger["points"][point]["state"] == "submitted", (ledger, again)
