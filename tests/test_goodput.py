"""Per-fault accounting users can see (hpcrun.goodput): a run's goodput and its lost seconds by
cause from rows of known times, the restart and recomputation of the attempt after a failed one
(the pure parts: a local run cannot restart inside its job), `hpcrun status RUN`'s line and the
report's table, from rows written with hpcrun's own writer."""

from __future__ import annotations

import datetime as dt
import html
import json
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from hpcrun.goodput import COLUMNS, goodput, restart_columns
from hpcrun.results import compact, load, write_attempt
from tests.helpers import ROOT, cli
from tests.test_login_node import PROBE

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
LINE = "goodput 0.60: lost 17 s detecting, 30 s restarting, 8 s recomputing, 90 s in the queue"


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def attempts(run_id: str = "r-faults") -> list[dict[str, object]]:
    """Three attempts at 1 s a step. 0: steps 0-100 in [0, 130], failed, noticed 12 s after its
    last step. 1, restarted in the job: restart 20 s, 8 steps again (resumed at 92 of 100), steps
    92-220 in [135, 300], failed, 5 s to notice. 2, after a requeue: 100 s between the rows of
    which 10 s restarting, steps 220-300 in [400, 500]. Wall 500 s, training 100 + 120 + 80."""
    plan = {"run_id": run_id, "job_id": "7", "step_time_p50_s": 1.0, "strategy": "ddp", "nodes": 1}
    return [
        {**plan, "attempt": 0, "start_time": at(0), "end_time": at(130), "status": "failed",
         "first_step": 0, "last_step": 100, "detect_s": 12.0},
        {**plan, "attempt": 1, "start_time": at(135), "end_time": at(300), "status": "failed",
         "first_step": 92, "last_step": 220, "detect_s": 5.0, "restart_s": 20.0, "recomputed_steps": 8,
         "recompute_s": 8.0},
        {**plan, "attempt": 2, "start_time": at(400), "end_time": at(500), "status": "completed",
         "first_step": 220, "last_step": 300, "restart_s": 10.0, "recomputed_steps": 0, "recompute_s": 0.0},
    ]


def test_goodput_of_rows_with_known_times(tmp_path: Path) -> None:
    from hpcrun.results import run_rows

    found = goodput(attempts())
    assert found is not None
    assert (found.wall_s, found.training_s, found.goodput, found.failures) == (500.0, 300.0, 0.6, 2)
    assert (found.detect_s, found.restart_s, found.recompute_s, found.queue_s) == (17.0, 30.0, 8.0, 90.0)
    assert found.line() == LINE
    # the same from the table: as pandas records (NA, NaT), and as the status view reads them, another
    # run's rows beside them, before and after compaction
    for row in [*attempts(), {**attempts("r-other")[0], "start_time": at(-1000)}]:
        write_attempt(tmp_path, row)
    assert goodput(load(tmp_path, run_id="r-faults").to_dict("records")) == found
    assert goodput(run_rows(tmp_path, "r-faults", COLUMNS)) == found
    compact(tmp_path)
    assert goodput(run_rows(tmp_path, "r-faults", COLUMNS)) == found
    assert goodput([]) is None and goodput([{"status": "failed"}]) is None


def test_restart_and_recomputation_after_a_failed_attempt() -> None:
    """The previous attempt's record (state.json's "failure") noticed the failure at t=1000 having
    reached step 40; this attempt resumed at 35 (a snapshot) and began its first step at 1015."""
    previous = {"error": "Killed (SIGKILL)", "resumed": 0, "reached": 40, "detected": 1000.0}
    in_job = restart_columns(previous, 1015.0, 500.0, 35, 100, 0.5)  # the allocation began long before
    assert in_job == {"restart_s": 15.0, "recomputed_steps": 5, "recompute_s": 2.5}
    # requeued: SLURM started the job again at 1130, first step at 1140; the wait before is the queue's
    assert restart_columns(previous, 1140.0, 1130.0, 35, 100, 0.5)["restart_s"] == 10.0
    # failed again two steps after resuming: only those two were recomputed
    assert restart_columns(previous, 1015.0, None, 35, 37, 0.5) == {
        "restart_s": 15.0, "recomputed_steps": 2, "recompute_s": 1.0}
    # resumed past where the previous attempt got (a disk checkpoint is never ahead, but the count never goes below 0)
    assert restart_columns(previous, 1015.0, None, 45, 100, 0.5)["recomputed_steps"] == 0
    nothing = {"restart_s": None, "recomputed_steps": None, "recompute_s": None}
    assert restart_columns(None, 1015.0, None, 35, 100, 0.5) == nothing
    old_record = {"error": "x", "resumed": None, "reached": 40}  # written before "detected" was kept
    assert restart_columns(old_record, 1015.0, None, 35, 100, 0.5) == {**nothing, "recomputed_steps": 5,
                                                                        "recompute_s": 2.5}


def test_the_row_after_a_failure_reads_its_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a resumed attempt's row adds (hpcrun.runtime.row.recovery), from the failure step's
    real record of the previous attempt and the batch script's starts file, with an attempt
    standing in for the Context: the restart runs from the notice to this attempt's first step."""
    from hpcrun.runtime.failure import record_failed_step, write_exit_record
    from hpcrun.runtime.metrics import Measurements
    from hpcrun.runtime.row import recovery
    from tests.test_failure_step import JOB, PEER_LEFT, failure_step_env, function_run

    run_dir, spec = function_run(tmp_path)
    failure_step_env(monkeypatch, tmp_path, 0)
    write_exit_record(run_dir, JOB, 0, 1, PEER_LEFT, 40, {"first_step": 0, "last_step": 40})
    record_failed_step(run_dir, 1, "srun: error: node2: task 1: Exited with exit code 1\n")
    detected = run_dir.state()["failure"]["detected"]
    starts = run_dir.starts(JOB)
    starts.parent.mkdir(parents=True, exist_ok=True)
    starts.write_text(f"0 0 {detected - 100:.0f} node1,node2\n0 1 {detected + 1:.0f} node1,node2\n")
    failure_step_env(monkeypatch, tmp_path, 1)
    measured = Measurements()
    measured.mark(0)  # this attempt's first step begins now
    env = types.SimpleNamespace(job_id=JOB, attempt=1, allocation_id=JOB)
    ctx = types.SimpleNamespace(spec=spec, env=env, measured=measured, start_step=35)
    found = recovery(ctx, 100, 0.5)  # type: ignore[arg-type]
    assert found["restart_s"] == pytest.approx(time.time() - detected, abs=1.0)
    assert (found["recomputed_steps"], found["recompute_s"]) == (5, 2.5)
    env.attempt = 2  # the state is not the previous attempt's: nothing to account for
    assert recovery(ctx, 100, 0.5) == dict.fromkeys(found)  # type: ignore[arg-type]


def test_status_of_one_run_prints_its_goodput(tmp_path: Path) -> None:
    """`hpcrun status RUN` of a run whose attempts failed and restarted: one goodput line, read
    from its own rows in the results table (another run's beside them)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    run_dir = tmp_path / "runs" / "r-faults"
    run_dir.mkdir(parents=True)
    results = tmp_path / "results"
    (run_dir / "runspec.json").write_text(json.dumps({"run_id": "r-faults", "results_dir": str(results)}))
    (run_dir / "jobs.json").write_text(json.dumps([{"job_id": str(gone.pid), "scheduler": "local",
                                                     "submitted": time.time() - 600}]))
    (run_dir / "state.json").write_text(json.dumps({"status": "completed", "job_id": str(gone.pid),
                                                    "attempt": 2}))
    for row in [*attempts(), *attempts("r-other")]:
        write_attempt(results, row)
    out = cli("status", str(run_dir))
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[-1] == f"  {LINE}", out.stdout
    # on a login node: no torch, and no pandas either for the rows of one run
    probe = PROBE.replace("'HEAVY='", "'HEAVY=' + ','.join(m for m in sys.modules if m == 'pandas') + ','")
    seen = subprocess.run([sys.executable, "-c", probe.format(args=["status", str(run_dir)])], capture_output=True,
                          text=True, cwd=ROOT)
    assert f"  {LINE}" in seen.stdout and seen.stdout.strip().splitlines()[-1] == "HEAVY=,", seen.stdout + seen.stderr


def test_report_shows_goodput_of_runs_with_failures(tmp_path: Path) -> None:
    from hpcrun.report import render
    from hpcrun.steps import load_steps
    from tests.test_report import sweep

    results = sweep(tmp_path)
    for row in attempts():
        write_attempt(results, row)
    page = html.unescape(render(load(results), load_steps(results)))
    table = page.split("<h2>Failures and goodput</h2>")[1].split("</table>")[0]
    cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>.*?</td>", table)]
    assert cells == ["r-faults", "3", "2", "60.0 %", "17 s", "30 s", "8 s", "90 s"]
    assert "<h2>Failures and goodput</h2>" not in render(load(sweep(tmp_path / "clean")), load_steps(results))
