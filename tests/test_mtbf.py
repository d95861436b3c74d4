"""The MTBF learned from the site's own failed attempts (hpcrun.mtbf), shown by `hpcrun plan`, and a
job's own failures tightening its cadence."""

from __future__ import annotations

import datetime as dt
import json
import types
import typing as tp
from pathlib import Path

import pandas as pd
import pytest

from hpcrun import backend, mtbf
from hpcrun.plan import RunSpec, plan
from hpcrun.recipe import load_recipe
from hpcrun.results import load, write_attempt
from hpcrun.site import load_site
from tests.helpers import cli
from tests.runs import recipe, site_copy

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
KILLED = "rank 3 on n2: Killed (SIGKILL) at step 40; restarting in the job (1 of 5)"
HUNG = "rank 0 on n1: hung (no step progress for fault.hang_timeout_s); silent: 1; requeueing"
NODE_LOST = "node lost (NODE_FAIL): n7; requeued by SLURM"


def row(status: str, reason: str | None, nodes: int, hours: float | None, partition: str = "gpu",
        cluster: str = "c1", kind: str = "benchmark") -> dict[str, tp.Any]:
    """A results row of an attempt on `nodes` nodes that ran `hours` (None: no start recorded)."""
    end = T0 + dt.timedelta(days=30)
    return {
        "run_id": "r", "cluster": cluster, "site": cluster, "partition": partition, "nodes": nodes,
        "job_kind": kind, "status": status, "reason": reason, "end_time": end,
        "start_time": None if hours is None else end - dt.timedelta(hours=hours),
    }


# on partition gpu of cluster c1: 3 failures of the machine in 750 node-hours
HISTORY = [
    row("completed", None, 2, 100),  # 200 node-hours
    row("failed", KILLED, 2, 50),  # 100, a failure
    row("failed", HUNG, 4, 25),  # 100, a failure
    row("failed", NODE_LOST, 4, None),  # no start recorded: a failure, no exposure
    row("failed", "rank 0 on n1: ValueError: bad batch at step 3; the call's own error, its result: not run again",
        1, 50),
    row("failed", "requeue cap reached (3 requeues); SIGUSR2 at step 9", 2, 50),  # a stop the cap made final
    row("failed", "the job step: CANCELLED DUE TO TIME LIMIT; requeueing", 1, 100),
    row("requeued", "SIGTERM at step 50, before the time limit", 1, 50),
    row("failed", "rank 1 on n3: RuntimeError: NCCL error at step 5; the same failure as the previous attempt "
        "(same error, no step past it): not requeued", 1, 25),
    row("failed", "rank 0 on n1: exit code 1; requeueing", 1, 25, kind="command"),  # the command's own status
    # elsewhere: not partition gpu of c1
    row("failed", KILLED, 1, 10, partition="cpu"),
    row("failed", KILLED, 8, 10, cluster="c2"),
]


def write(results: Path, rows: list[dict[str, tp.Any]]) -> Path:
    for r in rows:
        write_attempt(results, r)
    return results


@pytest.mark.parametrize("source", ["results.load", "site_rows", "a plain DataFrame"])
def test_failures_exposure_and_estimate_per_partition(tmp_path: Path, source: str) -> None:
    results = write(tmp_path / "results", HISTORY)
    rows = {"results.load": lambda: load(results), "site_rows": lambda: mtbf.site_rows(results),
            "a plain DataFrame": lambda: pd.DataFrame(HISTORY)}[source]()
    learned = mtbf.learn(rows, "gpu", 5000.0, cluster="c1")
    assert (learned.failures, learned.node_hours, learned.attempts) == (3, pytest.approx(750.0), 10)
    assert learned.node_mtbf_hours == pytest.approx((5000 + 750) / (1 + 3))
    assert learned.source() == (
        "learned on partition gpu from 3 failures in 750 node-hours of 10 attempts (prior 5000 h per node)"
    )
    cpu = mtbf.learn(rows, "cpu", 5000.0, cluster="c1")
    assert (cpu.failures, cpu.node_hours, cpu.node_mtbf_hours) == (1, pytest.approx(10.0), pytest.approx(2505.0))
    every_cluster = mtbf.learn(rows, "gpu", 5000.0)
    assert (every_cluster.failures, every_cluster.node_hours) == (4, pytest.approx(830.0))
    none = mtbf.learn(rows, "bigmem", 5000.0)
    assert (none.attempts, none.node_mtbf_hours) == (0, 5000.0)
    assert none.source() == "the site's node_mtbf_hours (no results of partition bigmem yet)"


@pytest.mark.parametrize(("status", "reason", "kind", "counted"), [
    ("failed", KILLED, "benchmark", True),
    ("failed", HUNG, "benchmark", True),
    ("failed", NODE_LOST, "benchmark", True),
    ("failed", "rank 2 on n4: Segmentation fault (SIGSEGV); node lost: n4; requeueing", "benchmark", True),
    ("failed", "the job step: CANCELLED DUE TO NODE FAILURE; requeue cap reached (3 requeues)", "benchmark", True),
    ("failed", "rank 0 on n1: exit code 1; requeueing", "entrypoint", True),  # no record: the rank died
    ("failed", "rank 0 on n1: exit code 1; requeueing", "command", False),
    ("failed", "rank 0: TypeError: f() missing 1 required positional argument", "function", False),
    ("failed", "HpcrunError: recipe.yaml: training.steps: must be > 0", "benchmark", False),
    ("failed", "rank 0 on n1: torch.OutOfMemoryError: CUDA out of memory at step 0; requeueing", "benchmark", False),
    ("failed", "timeout cap reached (2 timeouts); SIGUSR2 at step 9, at the time limit", "benchmark", False),
    ("failed", "the job step: CANCELLED; requeueing", "benchmark", False),  # scancel
    ("failed", "the job step: CANCELLED DUE TO PREEMPTION; requeueing", "benchmark", False),
    ("stopped", "SIGUSR2 at step 9; continue with hpcrun resume", "benchmark", False),
    ("completed", None, "benchmark", False),
])
def test_only_the_machines_failures_count(status: str, reason: str | None, kind: str, counted: bool) -> None:
    assert mtbf.machine_failure(status, reason, kind) is counted


def test_a_short_history_barely_moves_the_prior_and_a_long_one_dominates_it() -> None:
    short = pd.DataFrame([row("completed", None, 2, 50)])
    assert mtbf.learn(short, "gpu", 5000.0).node_mtbf_hours == pytest.approx(5100.0)
    # a row written before rows named their cluster is taken as the site's own
    assert mtbf.learn(pd.DataFrame([{**row("completed", None, 2, 50), "cluster": None}]), "gpu", 5000.0,
                      cluster="c1").node_hours == pytest.approx(100.0)
    # 100 failures in 100,000 node-hours: near the history's 1,000 h, far from the prior
    long = pd.DataFrame([row("failed", KILLED, 10, 100)] * 100)
    assert mtbf.learn(long, "gpu", 5000.0).node_mtbf_hours == pytest.approx(105_000 / 101)


def spec_on(tmp_path: Path, **fields: tp.Any) -> RunSpec:
    site = load_site(str(site_copy(tmp_path)))
    path = recipe(tmp_path, "learn", resources={"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"}, **fields)
    return plan(site, load_recipe(path).base, path, "learn-run")


def test_a_submission_carries_the_learned_mtbf(tmp_path: Path) -> None:
    spec = spec_on(tmp_path)
    assert spec.node_mtbf_hours is None  # plan() reads no files
    fresh = mtbf.resolve(spec)
    assert (fresh.node_mtbf_hours, fresh.mtbf_source) == (None, "the site's node_mtbf_hours (no results yet)")
    assert fresh.mtbf_s == 5000 * 3600
    history = [row("failed", KILLED, 1, 100, partition="local", cluster="local-test")] * 3
    write(Path(spec.results_dir), [{**r, "attempt_id": f"a{i}"} for i, r in enumerate(history)])
    learned = mtbf.resolve(spec)
    assert learned.node_mtbf_hours == pytest.approx((5000 + 300) / 4)
    assert learned.mtbf_s == pytest.approx((5000 + 300) / 4 * 3600)
    assert learned.cadence("snapshot").mtbf_s == learned.mtbf_s
    # what the job reads: the run directory's runspec.json
    run_dir = backend.prepare(spec)
    written = RunSpec.model_validate(json.loads((run_dir / "runspec.json").read_text()))
    assert written.node_mtbf_hours == learned.node_mtbf_hours
    assert written.mtbf_source.startswith("learned on partition local from 3 failures in 300 node-hours")
    # the recipe's own MTBF needs nothing learned
    stated = mtbf.resolve(spec_on(tmp_path, fault={"mtbf_hours": 12}))
    assert stated.mtbf_s == 12 * 3600 and stated.mtbf_said() == "MTBF 12.0 h: the recipe's fault.mtbf_hours"


def test_an_unreadable_history_falls_back_to_the_prior(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_on(tmp_path)
    write(Path(spec.results_dir), [row("failed", KILLED, 1, 1, partition="local", cluster="local-test")])

    def unreadable(paths: tuple[str, ...]) -> tp.Any:
        raise OSError(f"[Errno 5] Input/output error: {paths[0]!r}")

    monkeypatch.setattr(mtbf, "_read", unreadable)
    fallen = mtbf.resolve(spec)
    assert fallen.node_mtbf_hours is None and fallen.mtbf_s == 5000 * 3600
    assert fallen.mtbf_source.startswith(f"the site's node_mtbf_hours (results in {spec.results_dir} unread: ")
    assert "Input/output error" in fallen.mtbf_source
    backend.prepare(spec)  # and the submission goes on


def test_plan_prints_the_learned_mtbf_and_its_source(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    path = recipe(tmp_path, "planned", resources={"nodes": 1, "gpus_per_node": 2, "time": "00:10:00"},
                  checkpoint={"max_minutes": 10_000})
    before = cli("plan", "--site", str(site), str(path))
    assert before.exit_code == 0, before.output
    assert "MTBF 5000.0 h for 1 node: the site's node_mtbf_hours (no results yet)\n" in before.output
    write(tmp_path / "results", [
        row("failed", KILLED, 1, 30, partition="local", cluster="local-test"),
        row("failed", HUNG, 1, 20, partition="local", cluster="local-test"),
        row("failed", "rank 0 on n1: ValueError: bad at step 3; the call's own error, its result: not run again",
            1, 10, partition="local", cluster="local-test"),
        row("failed", KILLED, 1, 30, partition="gpu", cluster="local-test"),  # another partition's
    ])
    out = cli("plan", "--site", str(site), str(path))
    assert out.exit_code == 0, out.output
    assert ("MTBF 1686.7 h for 1 node: learned on partition local from 2 failures in 60 node-hours of 3 attempts "
            "(prior 5000 h per node)\n") in out.output
    # the intervals are spaced by it: Young/Daly's, the cap above it
    [checkpoints] = [line for line in out.output.splitlines() if line.startswith("checkpoints every")]
    assert "Young/Daly's sqrt(2 x cost x MTBF)" in checkpoints and checkpoints.endswith("MTBF 1686.7 h")


def test_a_jobs_own_failures_tighten_its_mtbf() -> None:
    starts = [
        " 0 1000 n1,n2",  # the first start (SLURM_RESTART_COUNT is empty before a requeue)
        " 1 4600 n1,n3",  # a failure after 3600 s trained: restarted in the job
        " 2 5600 n1,n3",  # another after 1000 s
        "1 0 90000 n1,n2",  # requeued (a time limit): no failure, and its end is unknown
        "1 1 91800 n1,n2",  # a failure after 1800 s
        "garbled",
    ]
    failures, trained = mtbf.in_job_history(starts)
    assert (failures, trained) == (3, 6400.0)
    planned = 1000 * 3600.0
    pooled = (planned + 6400) / 4
    assert mtbf.tightened(planned, failures, trained) == pytest.approx(pooled)
    # a burst: from a second failure in one allocation on, its own rate; the requeue's allocation (its
    # SLURM_RESTART_COUNT 1) has had one failure, after 1800 s, so the pooled estimate stays
    assert mtbf.this_allocation(starts[:-1]) == starts[3:5]
    assert mtbf.in_job_history(mtbf.this_allocation(starts[:-1])) == (1, 1800.0)
    assert mtbf.tightened(planned, failures, trained, (1, 1800.0)) == pytest.approx(pooled)
    # the first allocation's two failures in 4600 s trained
    assert mtbf.in_job_history(mtbf.this_allocation(starts[:3])) == (2, 4600.0)
    assert mtbf.tightened(planned, failures, trained, (2, 4600.0)) == pytest.approx(2300)
    assert mtbf.this_allocation([]) == []
    assert mtbf.in_job_history([" 0 1000 n1"]) == (0, 0.0)
    assert mtbf.tightened(planned, 0, 0.0) == planned
    # one failure is not yet a burst: the plan's MTBF counts as one more
    assert mtbf.tightened(planned, 1, 3600.0, (1, 3600.0)) == pytest.approx((planned + 3600) / 2)
    # a job that fails less often than its plan said keeps the pooled estimate
    assert mtbf.tightened(3600.0, 2, 90_000.0, (2, 90_000.0)) == pytest.approx((3600 + 90_000) / 3)
    assert mtbf.tightened(planned, 2, 0.0, (2, 0.0)) == 1.0  # two failures before any training: a second, not zero


def test_the_attempts_cadences_use_the_tightened_mtbf(tmp_path: Path) -> None:
    from hpcrun.rundir import RunDir
    from hpcrun.runtime.context import Context

    spec = spec_on(tmp_path, checkpoint={"memory_interval": None})
    run_dir = RunDir(tmp_path / "run")
    run_dir.starts("77").parent.mkdir(parents=True)
    run_dir.starts("77").write_text(" 0 1000 n1\n 1 4600 n1\n")
    said: list[str] = []
    ctx = types.SimpleNamespace(
        spec=spec, run_dir=run_dir, env=types.SimpleNamespace(allocation_id="77"), info=said.append,
        restored={}, checkpoints=types.SimpleNamespace(busy=False), snapshots=object(),
        unsaved_on_disk_s=lambda: 0.0,
    )
    ctx.own_mtbf_s = lambda: Context.own_mtbf_s(ctx)  # type: ignore[arg-type]
    disk, memory = Context.make_cadences(ctx)  # type: ignore[arg-type]
    assert memory is not None
    expected = (spec.mtbf_s + 3600) / 2
    assert disk.policy.mtbf_s == memory.policy.mtbf_s == pytest.approx(expected)
    assert said == [
        f"MTBF {expected / 3600:.1f} h: the plan's 5000.0 h with this job's 1 failure(s) in 60.0 min trained"
    ]
    ctx.env.allocation_id = "78"  # no starts of this allocation: the plan's
    assert Context.make_cadences(ctx)[0].policy.mtbf_s == spec.mtbf_s  # type: ignore[arg-type]
