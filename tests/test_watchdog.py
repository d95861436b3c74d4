"""The hang watchdog: a rank whose main thread makes no step progress is ended with its stacks in
its log, and the attempt's failure writer names the silent ranks from their heartbeats. On the
cluster (tests/test_cluster_faults.py) a SIGSTOPped rank ends the attempt (its peers' watchdogs
fire) and the job requeues and completes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpcrun.rundir import RunDir
from hpcrun.runtime import cause, failure, heartbeat
from hpcrun.runtime.watchdog import EXIT_HUNG, FLOOR_S, derived_timeout
from tests.helpers import ROOT


def test_watchdog_ends_a_rank_stuck_in_its_step(tmp_path: Path) -> None:
    """Main thread blocked forever after one step: the watchdog thread dumps every thread's
    stack (the stuck function included), leaves its exit record and exits; it reads no other
    rank's heartbeat (the failure writer does, once)."""
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
    assert "silent" not in out.stderr
    beat = json.loads((tmp_path / "heartbeats" / "7-0-rank0.json").read_text())
    assert beat["step"] == 0
    (record,) = RunDir(tmp_path).exit_records("7", 0)  # what the attempt's one record will say
    said = json.loads(record.read_text())
    assert said["error"] == failure.HUNG and said["step"] == 1, said
    assert took < 30


def hung(tmp_path: Path, world_size: int = 1) -> subprocess.CompletedProcess[str]:
    """Rank 0 of `world_size`, a 2 s fixed timeout, stuck after its first step."""
    code = textwrap.dedent(f"""
        import threading
        from hpcrun.rundir import RunDir
        from hpcrun.runtime.watchdog import Watchdog
        dog = Watchdog(RunDir({str(tmp_path)!r}), "7", 0, 0, {world_size}, timeout_s=2)
        dog.beat(0, 0.1)
        threading.Event().wait()
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)


def test_watchdog_outlives_its_own_errors(tmp_path: Path) -> None:
    """Neither a heartbeat nor an exit record can be written (their directories are files): each
    failure is a line on stderr, and the hung rank still ends with EXIT_HUNG."""
    (tmp_path / "heartbeats").write_text("not a directory")
    (tmp_path / "exits").write_text("not a directory")
    out = hung(tmp_path)
    assert out.returncode == EXIT_HUNG, out.stderr
    assert "heartbeat not written, watching on" in out.stderr and "hang not recorded" in out.stderr, out.stderr


def test_watchdog_ends_a_hung_rank_beside_a_foreign_heartbeat(tmp_path: Path) -> None:
    """Another rank's heartbeat file is not one (a JSON list): the hung rank still ends."""
    (tmp_path / "heartbeats").mkdir()
    (tmp_path / "heartbeats" / "7-0-rank1.json").write_text("[]")
    out = hung(tmp_path, world_size=2)
    assert out.returncode == EXIT_HUNG and "hung: no step progress" in out.stderr, out.stderr


def test_the_failure_writer_names_the_silent_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Of the ranks beside the one that fired (rank 0): a fresh heartbeat is running, a stale
    one and a missing one are silent, a foreign one is named with its file; seconds are left
    out of the reason (the same hang twice reads the same)."""
    run_dir = RunDir(tmp_path)
    at = time.time()
    interval = heartbeat.interval(5)
    for rank, alive in ((1, at - 1), (2, at - 4 * interval)):
        beat = {"rank": rank, "host": f"node{rank}", "step": 9, "stepped": alive, "alive": alive}
        run_dir.heartbeat("7", 0, rank).parent.mkdir(exist_ok=True)
        run_dir.heartbeat("7", 0, rank).write_text(json.dumps(beat))
    run_dir.heartbeat("7", 0, 3).write_text("[]")
    seen = cause.Failure(0, "node0", failure.HUNG, 10)
    named = failure.name_silent(run_dir, "7", 0, seen, {"rank": 0, "time": at}, world_size=5)
    assert named.what == f"{failure.HUNG}; silent: rank 2 on node2, rank 3, rank 4", named
    told = capsys.readouterr().err
    assert "rank 2 on node2 (not running for 20 s; last step 10)" in told and "7-0-rank3.json" in told, told
    other = cause.Failure(0, "node0", "RuntimeError: boom", 10)
    assert failure.name_silent(run_dir, "7", 0, other, {"rank": 0, "time": at}, world_size=5) == other


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
    """A blocking save twice the fixed timeout after a step that already took half of it (1 s
    of margin either side of the save: the watchdog looks once a second, and a loaded machine
    wakes a sleeper late)."""
    quiet(tmp_path, """
        dog.beat(0, 0.1)
        time.sleep(1.0)
        dog.beat(1, 1.0)
        with dog.saving():
            time.sleep(4.5)
        time.sleep(1.0)
        dog.beat(2, 1.0)
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
    assert derived_timeout([30.0, 31.0, 29.0, 30.0, 30.0]) == 155.0  # 5 x the slowest recent step


def test_a_stopped_rank_that_slurm_let_run_again_is_still_named(tmp_path: Path) -> None:
    """SLURM ends a step with SIGCONT before SIGKILL, so a SIGSTOPped rank may beat once more
    after the hang was declared (seen on the test cluster): its previous beat says when it last
    ran. A rank that beat all along (waiting in the collective), or just before it, is not named."""
    run_dir = RunDir(tmp_path)
    hung_at = time.time()
    fresh = heartbeat.write(run_dir, "7", 0, 1, 11, hung_at - 20, before=hung_at - 24)  # alive all along
    resumed = heartbeat.write(run_dir, "7", 0, 2, 11, hung_at - 20, before=hung_at - 22)  # stopped 22 s, then woken
    assert fresh >= hung_at and resumed >= hung_at
    fresh_path = run_dir.heartbeat("7", 0, 1)
    beat = json.loads(fresh_path.read_text())
    fresh_path.write_text(json.dumps({**beat, "before": hung_at - 3}))  # beat after the hang too, and just before
    # rank 3 beat 3 s before the hang, after a long gap: running when it was declared
    last = {**beat, "rank": 3, "alive": hung_at - 3, "before": hung_at - 60}
    run_dir.heartbeat("7", 0, 3).write_text(json.dumps(last))
    found = heartbeat.silent(run_dir, "7", 0, 4, hung_at, skip=0)
    assert [f.split(" (")[0] for f in found] == ["rank 2 on " + beat["host"]], found
