"""The hang watchdog: a rank whose main thread makes no step progress is ended with its stacks in
its log and the silent ranks named; on the cluster a SIGSTOPped rank ends the attempt (its
peers' watchdogs fire) and the job requeues and completes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpcrun.rundir import RunDir
from hpcrun.runtime.watchdog import EXIT_HUNG, FLOOR_S, derived_timeout
from tests.helpers import ROOT


def test_watchdog_ends_a_rank_stuck_in_its_step(tmp_path: Path) -> None:
    """Main thread blocked forever after one step: the watchdog thread dumps every thread's
    stack (the stuck function included), names rank 1 (never beat) as silent and exits."""
    code = textwrap.dedent(f"""
        import threading
        from hpcrun.rundir import RunDir
        from hpcrun.runtime.watchdog import Watchdog
        def stuck_in_a_collective():
            threading.Event().wait()
        dog = Watchdog(RunDir({str(tmp_path)!r}), "7", 0, 0, 2, timeout_s=2)
        dog.beat(0, 0.1)
        stuck_in_a_collective()
    """)
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    took = time.monotonic() - began
    assert out.returncode == EXIT_HUNG, out.stderr
    assert "hung: no step progress for 2 s after step 1" in out.stderr
    assert "stuck_in_a_collective" in out.stderr  # the main thread's stack
    assert "silent ranks: rank 1 (no heartbeat)" in out.stderr
    beat = json.loads((tmp_path / "heartbeats" / "7-0-rank0.json").read_text())
    assert beat["step"] == 0
    (record,) = RunDir(tmp_path).exit_records("7", 0)  # what the attempt's one record will say
    said = json.loads(record.read_text())
    assert said["error"] == "hung (no step progress for fault.hang_timeout_s); silent: rank 1" and said["step"] == 1, said
    assert took < 30


def test_watchdog_quiet_while_steps_progress(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import time
        from hpcrun.rundir import RunDir
        from hpcrun.runtime.watchdog import Watchdog
        dog = Watchdog(RunDir({str(tmp_path)!r}), "7", 0, 0, 1, timeout_s=2)
        for step in range(8):
            time.sleep(0.5)
            dog.beat(step, 0.5)
        dog.stop()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "hung" not in out.stderr, out.stderr


def quiet(tmp_path: Path, body: str) -> None:
    """`body` runs with `dog`, a Watchdog of a 2 s fixed timeout, and must end without firing."""
    code = textwrap.dedent("""
        import time
        from hpcrun.rundir import RunDir
        from hpcrun.runtime.watchdog import Watchdog
        dog = Watchdog(RunDir({path!r}), "7", 0, 0, 1, timeout_s=2)
    """).format(path=str(tmp_path)) + textwrap.dedent(body) + "dog.stop()\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "hung" not in out.stderr, (out.returncode, out.stderr)


def test_watchdog_does_not_time_the_first_step(tmp_path: Path) -> None:
    """A first step (compilation, communicators' setup) twice the fixed timeout is not a hang."""
    quiet(tmp_path, """
        time.sleep(4.5)
        dog.beat(0, 4.5)
        time.sleep(0.5)
        dog.beat(1, 0.5)
    """)


def test_watchdog_quiet_during_a_long_save(tmp_path: Path) -> None:
    """A blocking save twice the fixed timeout after a step that already took most of it."""
    quiet(tmp_path, """
        dog.beat(0, 0.1)
        time.sleep(1.5)
        dog.beat(1, 1.5)
        with dog.saving():
            time.sleep(4.5)
        time.sleep(1.5)
        dog.beat(2, 1.5)
    """)


def test_watchdog_times_steps_again_after_a_save(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import threading
        from hpcrun.rundir import RunDir
        from hpcrun.runtime.watchdog import Watchdog
        dog = Watchdog(RunDir({str(tmp_path)!r}), "7", 0, 0, 1, timeout_s=2)
        dog.beat(0, 0.1)
        with dog.saving():
            pass
        threading.Event().wait()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == EXIT_HUNG and "hung: no step progress for 2 s after step 1" in out.stderr, out.stderr


def test_derived_timeout_has_a_floor() -> None:
    assert derived_timeout([0.1, 0.2, 0.1, 0.3, 0.1]) == FLOOR_S
    assert derived_timeout([30.0, 31.0, 29.0, 30.0, 30.0]) == 600.0


@pytest.mark.cluster
@pytest.mark.slow
def test_sigstopped_rank_ends_the_attempt_and_the_job_completes(tmp_path: Path) -> None:
    """One rank of a 2-node x 2-rank job is SIGSTOPped with `fault.hang_timeout_s: 60`: the other
    ranks' watchdogs fire within 120 s, their stacks are in the run's logs, the job requeues
    and completes with the weights of an uninterrupted run."""
    from tests import faults
    from tests.runs import recipe, rows, run_dir_of, site_copy
    from tests.test_cluster_faults import CHECKPOINT, PAUSED, TRAINING, records, submit, wait_checkpoint, wait_done

    began = time.monotonic()
    resources = {"nodes": 2, "gpus_per_node": 2, "time": "00:10:00"}
    run_dir, job = submit(tmp_path, "hung", resources=resources, fault={"hang_timeout_s": 60})
    # the uninterrupted baseline: 4 ranks on this machine (same world size, same numbers), run
    # while the cluster job hangs and requeues
    partition = {"max_nodes": 1, "gpus_per_node": 0, "cpus_per_node": 4, "memory_gb": 16, "max_time": "1-00:00:00"}
    local = site_copy(tmp_path, partitions={"local": partition})
    whole = recipe(tmp_path, "hung-whole", job=PAUSED | {"args": {"step_delay_s": 0.0, "model": "tiny"}}, training=TRAINING,
                   checkpoint=CHECKPOINT, resources={"nodes": 1, "gpus_per_node": 4, "time": "00:10:00"})
    baseline_run = subprocess.Popen([sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(local), "--wait", str(whole)],
                                    stdout=subprocess.PIPE, text=True, cwd=ROOT)
    wait_checkpoint(run_dir)
    faults.signal_rank(job, 3, signal.SIGSTOP)
    stopped = time.monotonic()
    deadline = stopped + 150
    while time.monotonic() < deadline and records(job)[:1] != ["REQUEUED"]:
        time.sleep(1)
    ended = time.monotonic() - stopped
    assert records(job)[:1] == ["REQUEUED"], records(job)
    assert ended < 120 + 10, ended  # 60 s timeout, 1 s polling, srun's teardown
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*") if p.is_file())
    assert logs.count("hung: no step progress for 60 s") >= 2, logs[-3000:]  # every rank that can run
    assert "Thread" in logs and "silent ranks: rank 3 on" in logs, logs[-3000:]
    failed = [r for r in rows(tmp_path, run_dir).to_dict("records") if r["status"] == "failed"]
    assert len(failed) == 1 and "hung (no step progress" in failed[0]["reason"] and "silent: rank 3 on" in failed[0]["reason"], failed
    final = wait_done(run_dir, timeout=400)
    assert final["status"] == "completed", final
    out, _ = baseline_run.communicate(timeout=600)
    assert baseline_run.returncode == 0, out
    baseline = run_dir_of(subprocess.CompletedProcess([], 0, out, ""))
    assert (run_dir / "weights.sha256").read_text() == (baseline / "weights.sha256").read_text()
    print(f"duration {time.monotonic() - began:.0f} s (attempt ended {ended:.0f} s after SIGSTOP)")
