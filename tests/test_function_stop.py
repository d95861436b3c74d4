"""A submitted call (a function job) stopped by a signal, decided as submitit's SignalHandler decides
it: at its time limit, a callable without a checkpoint method is not requeued and its result is
submitit's error; preempted, it is requeued whatever the callable. One rank of a planned SLURM run,
its real function pickle and the batch script's record of when the job started, off the cluster."""

from __future__ import annotations

import dataclasses
import signal
import time
import typing as tp
from pathlib import Path

import pytest
from submitit.core.utils import DelayedSubmission, JobPaths, pickle_load

from hpcrun.plan import RunSpec, plan
from hpcrun.recipe import Recipe
from hpcrun.rundir import RunDir
from hpcrun.runtime.attempt import stop_decision
from hpcrun.runtime.context import Context
from hpcrun.runtime.env import from_environ
from hpcrun.runtime.function import CallRaised, run_function
from hpcrun.signals import SignalFlag
from hpcrun.site import load_site
from tests import functions

JOB = "4242"


def stopped_call(tmp: Path, function: tp.Callable[..., tp.Any], *args: tp.Any, into_limit_s: float) -> Context:
    """A run of `function(*args)` whose job started its time limit ago, stopped by USR2 `into_limit_s`
    seconds after SLURM's time to send it (the limit less the signal lead)."""
    recipe = Recipe.model_validate(
        {"name": "f", "job": {"kind": "function"}, "resources": {"partition": "spare"}}
    )
    spec: RunSpec = plan(load_site("testcluster"), recipe, "f.yaml", "run").model_copy(
        update={"run_dir": str(tmp / "run"), "results_dir": str(tmp / "results")}
    )
    run_dir = RunDir(spec.run_dir)
    run_dir.path.mkdir()
    run_dir.spec.write_text(spec.model_dump_json())
    DelayedSubmission(function, *args).dump(run_dir.function)
    started = time.time() - spec.time_min * 60
    run_dir.starts(JOB).parent.mkdir()
    run_dir.starts(JOB).write_text(f" 0 {started:.0f} node1\n")  # SLURM_RESTART_COUNT is empty before a requeue
    flag = SignalFlag()
    flag.signum, flag.at = signal.SIGUSR2, started + spec.time_min * 60 - spec.signal_lead_s + into_limit_s
    env = dataclasses.replace(from_environ(job_id=JOB, allocation_id=JOB), attempt=0, slurm_requeues=0)
    return Context(spec, env, flag)


@pytest.fixture(autouse=True)
def job_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_function sets what submitit's JobEnvironment reads: undone after each test."""
    for name in ("SUBMITIT_EXECUTOR", "SUBMITIT_FOLDER", "HPCRUN_JOB_ID"):
        monkeypatch.setenv(name, "")
    for name in ("HPCRUN_RESTARTS_IN_JOB", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def outcome(ctx: Context) -> tp.Any:
    path = JobPaths(ctx.run_dir.logs, job_id=JOB, task_id=0).result_pickle
    return pickle_load(path) if path.exists() else None


def test_a_call_without_checkpoint_is_not_requeued_at_its_time_limit(tmp_path: Path) -> None:
    """USR2 at the time limit (here 30 s after the signal lead began) to a plain function: it
    raises, as submitit's handler raises into it, and its result is submitit's error."""
    ctx = stopped_call(tmp_path, functions.square, 3, 0.0, into_limit_s=30)
    with pytest.raises(CallRaised) as raised:
        run_function(ctx)
    assert str(raised.value).startswith(
        "UncompletedJobError: Job not requeued because: timed-out and not checkpointable."), raised.value
    kind, text = outcome(ctx)
    assert kind == "error" and text.strip().endswith(
        "UncompletedJobError: Job not requeued because: timed-out and not checkpointable."), text


def test_a_preempted_call_without_checkpoint_is_requeued(tmp_path: Path) -> None:
    """USR2 half an hour before the limit: a preemption, which submitit requeues whatever the
    callable; the requeued job calls it again from the start (its pickle is unchanged)."""
    ctx = stopped_call(tmp_path, functions.square, 3, 0.0, into_limit_s=-1800)
    before = ctx.run_dir.function.read_bytes()
    run_function(ctx)
    assert ctx.stopped == "SIGUSR2" and stop_decision(ctx) == ("requeued", "SIGUSR2 at step 1", None)
    assert outcome(ctx) is None and ctx.run_dir.function.read_bytes() == before


def test_a_checkpointable_call_is_requeued_at_its_time_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Checkpointable callable at the time limit: checkpointed and stopped for requeue, no
    result yet."""
    ctx = stopped_call(tmp_path, functions.Counter(), 5, 0.0, str(tmp_path / "progress"), into_limit_s=30)
    run_function(ctx)
    assert ctx.stopped == "SIGUSR2" and stop_decision(ctx)[0] == "requeued"
    assert outcome(ctx) is None
    assert "checkpointed the call: the requeued job continues from it" in capsys.readouterr().out
