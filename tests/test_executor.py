"""submitit's executor plugin (hpcrun.executor) without SLURM: calls on hpcrun's local controller
(`--site local`), submitit's parameters mapped onto the recipe, and refusals naming the parameter.
The cluster's side is tests/test_cluster_executor.py."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import submitit

import hpcrun
from hpcrun import api
from hpcrun.errors import HpcrunError
from tests import functions
from tests.helpers import ROOT
from tests.runs import site_copy, wait_for


@pytest.fixture
def no_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH with bash and nothing of SLURM's, as on a laptop."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    monkeypatch.setenv("PATH", str(bindir))
    assert shutil.which("sbatch") is None


def test_a_function_runs_on_the_local_site_without_slurm(tmp_path: Path, no_slurm: None) -> None:
    ex = submitit.AutoExecutor(tmp_path / "submitit", cluster="hpcrun", hpcrun_site=str(site_copy(tmp_path)))
    ex.update_parameters(tasks_per_node=2, timeout_min=5)
    job = ex.submit(functions.where, 3)
    results = job.results()
    assert [(r["x"], r["rank"], r["world"], r["env_rank"], r["env_tasks"], r["job_id"]) for r in results] == [
        (3, 0, 2, 0, 2, job.job_id), (3, 1, 2, 1, 2, job.job_id)]
    assert job.done() and "rank 1/2" in (job.task(1).stdout() or "")
    port = int(results[0]["torch_env"][1])
    assert [r["torch_env"] for r in results] == [("127.0.0.1", port, 0, 2, 2), ("127.0.0.1", port, 1, 2, 2)]
    [run] = api.runs(str(tmp_path / "local-test.yaml"))
    assert run.path == job.paths.folder.parent and run.spec().recipe.job.kind == "function"
    # the executor's folder holds what submitit users look for there: links to the tasks' logs and results
    folder = tmp_path / "submitit"
    assert (folder / f"{job.job_id}_1_log.out").read_text() == job.task(1).stdout()
    assert pickle.loads((folder / f"{job.job_id}_0_result.pkl").read_bytes()) == ("success", results[0])
    assert pickle.loads((folder / f"{job.job_id}_submitted.pkl").read_bytes()).args == (3,)
    wait_for(lambda: run.status().done, "the local controller's exit", 60)
    assert run.status().state == "COMPLETED"
    assert job.submission().args == (3,)


def test_hpcrun_executor_maps_submitits_names_and_runs_an_array_of_calls(tmp_path: Path) -> None:
    ex = hpcrun.Executor(site=str(site_copy(tmp_path)))
    assert ex.name() == "hpcrun"
    ex.update_parameters(slurm_partition="local", time=3, tasks_per_node=1, slurm_array_parallelism=2,
                         recipe={"env": {"FROM_RECIPE": "yes"}}, slurm_mem="2G", max_num_timeout=2,
                         use_srun=True, stderr_to_stdout=False)  # the last two: what hpcrun does anyway
    jobs = ex.map_array(functions.square, [2, 3, 4], [0.0] * 3)
    assert [job.result() for job in jobs] == [4, 9, 16]
    spec = api.Run(jobs[0].paths.folder.parent).spec()
    assert (spec.partition, spec.time_min, spec.ranks_per_node, spec.env["FROM_RECIPE"]) == ("local", 3, 1, "yes")
    assert (spec.recipe.resources.mem_gb, spec.recipe.checkpoint.max_timeouts) == (2.0, 2)
    ex.update_parameters(gpus_per_task=1)  # hpcrun's layout (a GPU per rank), which asks for GPUs all the same
    with pytest.raises(HpcrunError) as refused:
        ex.submit(functions.square, 2, 0.0)
    assert refused.value.field == "gpus_per_task" and "has no GPUs" in refused.value.message


@pytest.mark.parametrize(
    ("parameters", "named", "said"),
    [
        ({"slurm_constraint": "a100"}, "slurm_constraint", "partition `constraint` is used"),
        ({"gpus_per_nod": 1}, "gpus_per_nod", "unknown parameter"),
        ({"array_parallelism": 0}, "array_parallelism", ">= 1"),
        ({"slurm_mem_per_gpu": "8G"}, "slurm_mem_per_gpu", "memory per node: use mem_gb (or mem)"),
        ({"mem_per_cpu": "2G"}, "mem_per_cpu", "memory per node: use mem_gb (or mem)"),
        ({"slurm_mem": "lots"}, "slurm_mem", "must be a size such as 16G or 500M"),
        ({"cpus_per_gpu": 4}, "cpus_per_gpu", "use cpus_per_task"),
        ({"gpus_per_task": 2}, "gpus_per_task", "one GPU (gpus_per_task=1)"),
        ({"gres": "gpu:1"}, "gres", "partition `gpu_request`"),
        ({"comment": "x"}, "comment", "--comment tags the job"),
        ({"slurm_exclude": "node1"}, "slurm_exclude", "excluded nodes itself"),
        ({"nodelist": "node1"}, "nodelist", "places the ranks"),
        ({"teardown": ["echo"]}, "teardown", "after the ranks"),
        ({"mail_user": "me@x"}, "mail_user", "environment.sbatch"),
        ({"dependency": "afterok:7"}, "dependency", "local site starts each call at once"),
    ],
)
def test_a_parameter_that_cannot_map_is_refused_by_name(
    tmp_path: Path, parameters: dict[str, object], named: str, said: str
) -> None:
    ex = hpcrun.Executor(site=str(site_copy(tmp_path)))
    with pytest.raises(HpcrunError) as refused:
        ex.update_parameters(**parameters)
    assert refused.value.field == named and said in refused.value.message, refused.value.message
    assert refused.value.exit_code == 2


@pytest.mark.parametrize(
    ("parameters", "named", "said"),
    [
        ({"nodes": 2}, "nodes", "must be <= 1"),
        ({"gpus_per_node": 1}, "gpus_per_node", "has no GPUs"),
        ({"tasks_per_node": 2, "gpus_per_node": 1}, "gpus_per_node", "one rank per GPU"),
        ({"timeout_min": 0}, "timeout_min", "at least one minute"),
        ({"mem_gb": 64}, "mem_gb", "must be <= 16, the memory per node of partition 'local'"),
        ({"mem_gb": 0}, "mem_gb", "greater than 0"),
        ({"hpcrun_max_num_timeout": 4}, "max_num_timeout", "must be <= checkpoint.max_requeues (3)"),
    ],
)
def test_a_value_the_site_cannot_give_is_refused_by_parameter_before_anything_runs(
    tmp_path: Path, parameters: dict[str, object], named: str, said: str
) -> None:
    ex = submitit.AutoExecutor(tmp_path / "submitit", cluster="hpcrun", hpcrun_site=str(site_copy(tmp_path)))
    ex.update_parameters(**parameters)
    with pytest.raises(HpcrunError) as refused:
        ex.submit(functions.square, 1, 0.0)
    assert refused.value.field == named and said in refused.value.message, refused.value.message
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_importing_hpcrun_loads_neither_submitit_nor_torch() -> None:
    """Nor does making the executor, through submitit's plugin discovery: it runs on a login node."""
    code = ("import sys, hpcrun; assert not {'submitit', 'torch'} & set(sys.modules), sorted(sys.modules)\n"
            "import submitit; ex = submitit.AutoExecutor('unused', cluster='hpcrun'); assert ex.cluster == 'hpcrun'\n"
            "assert isinstance(ex._executor, hpcrun.Executor) and 'torch' not in sys.modules, sorted(sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr


def test_job_cancel_stops_a_local_call_through_hpcruns_cancel(tmp_path: Path) -> None:
    ex = hpcrun.Executor(tmp_path / "submitit", site=str(site_copy(tmp_path)))
    ex.update_parameters(tasks_per_node=1, timeout_min=5)
    job = ex.submit(functions.square, 4, 300.0)
    wait_for(lambda: "start" in (job.stdout() or ""), "the call to start", 60)
    assert not job.done()
    job.cancel()
    wait_for(job.done, "the cancelled call's end", 60)
    assert job.state == "STOPPED"  # interrupted by SIGTERM: a stop, which `hpcrun resume` continues
    assert not job.paths.result_pickle.exists()  # job.result() raises UncompletedJobError
