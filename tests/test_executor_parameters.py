"""submitit's SlurmExecutor parameters on hpcrun's executor (hpcrun.executor), without SLURM: `mem`,
`dependency` and the executor's folder on a SLURM site whose `sbatch` is faked at the process
boundary, and `max_num_timeout` through the stop decision (hpcrun.runtime.attempt) of the run it
planned, which counts a stop at the time limit and not a preemption, as submitit does. The
refusals are in tests/test_executor.py; the cluster's side in tests/test_cluster_executor.py."""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import JobPaths

import hpcrun
from hpcrun.backend import load_spec
from hpcrun.errors import HpcrunError
from hpcrun.rundir import RunDir
from hpcrun.runtime.attempt import finish, stop_decision
from hpcrun.runtime.context import Context
from hpcrun.runtime.env import from_environ
from hpcrun.signals import SignalFlag
from tests import functions
from tests.runs import site_copy

SBATCH = '#!/bin/bash\necho "$@" >>"$FAKE_LOG"; cp "${@: -1}" "$FAKE_LOG.script"; echo "4242;hpctest"\n'


@pytest.fixture
def slurm_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test cluster's site, with an `sbatch` that records what it was sent and answers job 4242."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text(SBATCH)
    (bindir / "sbatch").chmod(0o755 | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.log"))
    return site_copy(tmp_path, "testcluster")


def test_mem_dependency_and_the_folders_links_on_a_slurm_site(tmp_path: Path, slurm_site: Path) -> None:
    ex = hpcrun.Executor(tmp_path / "submitit" / "%j", site=str(slurm_site))
    ex.update_parameters(slurm_mem="1.5G", slurm_dependency="afterok:7", tasks_per_node=2, timeout_min=5)
    job = ex.submit(functions.square, 3, 0.0)
    sent = (tmp_path / "calls.log.script").read_text()
    assert "#SBATCH --mem=1536M" in sent.splitlines(), sent
    assert (tmp_path / "calls.log").read_text().split()[:2] == ["--parsable", "--dependency=afterok:7"]
    # the folder holds what submitit users look for there, under submitit's names: links to the run's files
    run = RunDir(job.paths.folder.parent)
    folder = tmp_path / "submitit" / "4242"
    assert (folder / "4242_submission.sh").read_text() == sent == run.script.read_text()
    assert (folder / "4242_submitted.pkl").resolve() == run.function.resolve()
    for task in (0, 1):
        theirs = JobPaths(job.paths.folder, "4242", task)
        assert [(folder / f"4242_{task}_{name}").readlink() for name in ("log.out", "log.err", "result.pkl")] == [
            theirs.stdout, theirs.stderr, theirs.result_pickle]

    ex.update_parameters(mem_gb=8)
    with pytest.raises(HpcrunError) as refused:
        ex.submit(functions.square, 3, 0.0)
    assert refused.value.field == "mem_gb" and "must be <= 3.9, the memory per node" in refused.value.message


def _stop(spec_dir: Path, slurm_requeues: int, started: float, signalled: float) -> tuple[str, str | None]:
    """One attempt of the run stopped by a signal at `signalled` in a start of the job at `started`
    (as the batch script records it), decided and recorded as the attempt does."""
    run = RunDir(spec_dir)
    spec = load_spec(run.path)
    starts = run.starts("4242")
    starts.parent.mkdir(exist_ok=True)
    with starts.open("a") as out:  # SLURM_RESTART_COUNT is empty before the first requeue
        out.write(f"{slurm_requeues or ''} 0 {started:.0f} node1\n")
    env = dataclasses.replace(from_environ(job_id="4242", allocation_id="4242"), attempt=slurm_requeues,
                              slurm_requeues=slurm_requeues)
    flag = SignalFlag()
    flag.signum, flag.at = 12, signalled
    ctx = Context(spec, env, flag)
    ctx.stopped = "SIGUSR2"
    status, reason, timeouts = stop_decision(ctx)
    finish(ctx, status, reason, collective=False, job_timeouts=timeouts)
    return status, reason


def test_max_num_timeout_counts_stops_at_the_time_limit_not_preemptions(tmp_path: Path, slurm_site: Path) -> None:
    # submitit's own spelling: an executor's argument, through AutoExecutor's prefix
    ex = submitit.AutoExecutor(tmp_path / "submitit", cluster="hpcrun", hpcrun_site=str(slurm_site),
                               hpcrun_max_num_timeout=1)
    ex.update_parameters(tasks_per_node=1, timeout_min=60, hpcrun_signal_delay_s=120)
    job = ex.submit(functions.square, 3, 0.0)
    run = job.paths.folder.parent
    assert load_spec(run).recipe.checkpoint.max_timeouts == 1
    hour_ago = time.time() - 3600
    # USR2 the signal lead (120 s) ahead of the limit, sent 50 s early (SLURM may): a timeout, the first allowed
    assert _stop(run, 0, hour_ago, hour_ago + 3600 - 170) == (
        "requeued", "SIGUSR2 at step 1, at the time limit (timeout 1 of 1)")
    # preempted half-way through the next start: requeued, not counted
    assert _stop(run, 1, hour_ago, hour_ago + 1800) == ("requeued", "SIGUSR2 at step 1, before the time limit")
    assert RunDir(run).state()["timeouts"] == 1
    # the second timeout is one too many: the run ends (requeues left under checkpoint.max_requeues, 3)
    assert _stop(run, 2, hour_ago, hour_ago + 3590) == (
        "failed", "timeout cap reached (1 timeouts); SIGUSR2 at step 1, at the time limit")


def test_without_max_num_timeout_a_stop_at_the_limit_counts_as_any_requeue(tmp_path: Path, slurm_site: Path) -> None:
    """A recipe without `checkpoint.max_timeouts` (every run not from the executor's `max_num_timeout`)
    is decided as before: only `max_requeues` bounds its requeues."""
    ex = hpcrun.Executor(tmp_path / "submitit", site=str(slurm_site), recipe={"checkpoint": {"max_requeues": 1}})
    ex.update_parameters(tasks_per_node=1, timeout_min=60)
    run = ex.submit(functions.square, 3, 0.0).paths.folder.parent
    hour_ago = time.time() - 3600
    assert _stop(run, 0, hour_ago, hour_ago + 3590) == ("requeued", "SIGUSR2 at step 1")
    assert _stop(run, 1, hour_ago, hour_ago + 3590) == ("failed", "requeue cap reached (1 requeues); SIGUSR2 at step 1")
    assert "timeouts" not in RunDir(run).state()
