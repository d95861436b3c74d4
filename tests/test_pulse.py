"""Detection in seconds (hpcrun.runtime.pulse, hpcrun.runtime.watchdog): a rank that stops or dies
is seen by the next rank of the pulse ring within `fault.peer_timeout_s`; a rank that is slow but
alive (a long save, evaluation on a core, a data stall shorter than the floor) is not taken for a
hung one; a live rank stuck waiting is, after the derived timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import typing as tp
from pathlib import Path

from hpcrun.rundir import RunDir
from hpcrun.runtime import failure
from hpcrun.runtime.pulse import PULSE_S, Pulse
from hpcrun.runtime.watchdog import EXIT_HUNG
from tests.helpers import ROOT


def ring(size: int, timeout_s: float) -> list[Pulse]:
    """`size` ranks' pulses in one process, their addresses exchanged as the collective would."""
    barrier, shared = threading.Barrier(size), [None] * size
    made: list[Pulse | None] = [None] * size

    def make(rank: int) -> None:
        def gather(value: tp.Any) -> list[tp.Any]:
            shared[rank] = value
            barrier.wait()
            return list(shared)

        made[rank] = Pulse(rank, size, timeout_s, "127.0.0.1", gather, host="testhost")

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(made), made
    return [p for p in made if p is not None]


def run_for(pulses: list[Pulse], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for pulse in pulses:
            pulse.tick()
        time.sleep(PULSE_S / 5)


def test_the_next_rank_sees_a_silent_one_and_no_other() -> None:
    """Three ranks pulse; rank 1 stops: rank 2 (its successor) finds it silent after the timeout,
    naming it, and nobody else is silent; while all pulse, none is."""
    pulses = ring(3, timeout_s=1.0)
    run_for(pulses, 1.5)
    assert [p.silent_s() for p in pulses] == [None, None, None]
    run_for([pulses[0], pulses[2]], 1.6)  # rank 1 stopped
    quiet = [pulses[0].silent_s(), pulses[2].silent_s()]  # rank 1, stopped, asks nothing
    assert quiet[0] is None and quiet[1] is not None and quiet[1] > 1.0, quiet
    assert pulses[2].watched == "rank 1 on testhost"
    for pulse in pulses:
        pulse.close()


def test_a_rank_that_leaves_the_loop_says_goodbye() -> None:
    """A rank that ended its loop (training done, or its own error: it has its own record) is
    not taken for a silent one."""
    pulses = ring(2, timeout_s=1.0)
    run_for(pulses, 0.5)
    pulses[0].close()
    run_for([pulses[1]], 1.6)
    assert pulses[1].silent_s() is None
    pulses[1].close()


def watched_rank(
    tmp_path: Path, body: str, floor_s: float = 2.0, fixed: str = "None", busy_cap_s: float = 600.0
) -> subprocess.Popen[str]:
    """Rank 1 of 2 in a process of its own, its watchdog's derived timeout floored at `floor_s`,
    pulsing to and hearing from rank 0 (this test, through `peer`), then running `body`."""
    code = textwrap.dedent(f"""
        import json, socket, sys, threading, time
        from hpcrun.rundir import RunDir
        from hpcrun.runtime.pulse import Pulse
        from hpcrun.runtime.watchdog import Watchdog
        def gather(value):
            print(value, flush=True)
            return [sys.stdin.readline().strip(), value]
        pulse = Pulse(1, 2, 4.0, "127.0.0.1", gather, host="testhost")
        dog = Watchdog(RunDir({str(tmp_path)!r}), "7", 0, 1, 2, timeout_s={fixed}, pulse=pulse, floor_s={floor_s},
                       busy_cap_s={busy_cap_s})
        dog.beat(0, 0.1)
    """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


class Peer:
    """Rank 0 of the pair: pulses to the rank under test from this process."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdin and proc.stdout
        theirs = proc.stdout.readline().strip()
        self.pulse = Pulse(0, 2, 60.0, "127.0.0.1", lambda mine: [mine, theirs], host="testhost")
        proc.stdin.write(json.dumps(["127.0.0.1", self.pulse.sock.getsockname()[1], "testhost"]) + "\n")
        proc.stdin.flush()
        self.beating = True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while self.beating:
            self.pulse.tick()
            time.sleep(PULSE_S)


def test_a_stopped_peer_ends_the_attempt_in_seconds_naming_it(tmp_path: Path) -> None:
    """Rank 0 stops pulsing (SIGSTOPped, its node gone): rank 1, waiting for it in a collective,
    ends the attempt with a record naming rank 0, long before any hang timeout (600 s here)."""
    proc = watched_rank(tmp_path, "threading.Event().wait()\n", fixed="600")
    peer = Peer(proc)
    time.sleep(3)  # pulsing: nothing happens
    assert proc.poll() is None
    peer.beating = False
    stopped = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_HUNG, err
    assert "rank 0 on testhost silent for" in err, err
    (record,) = RunDir(tmp_path).exit_records("7", 0)
    said = json.loads(record.read_text())
    assert said["error"] == f"{failure.PEER_SILENT}: rank 0 on testhost" and said["rank"] == 1, said
    assert time.monotonic() - stopped < 60  # the pulse's 4 s, not the 600 s hang timeout
    # rank 0 marked silent for the batch script's watcher, which then need not wait for its task
    assert RunDir(tmp_path).named_silent("7", 0, 0).exists()
    assert not RunDir(tmp_path).named_silent("7", 0, 1).exists()


def test_a_rank_busy_on_a_core_is_not_hung_until_the_cap(tmp_path: Path) -> None:
    """The derived timeout, floored at 1 s here: 2 s of evaluation on a core (no step ends) pass;
    then the training thread spins forever without a step (as a wait on a GPU does): busy counts as
    work for 3 s (the cap, 10 minutes by default) after the last step, then the timeout (5 x the
    slowest step, 5 s) runs and the watchdog ends it as hung."""
    body = """
        end = time.monotonic() + 2
        while time.monotonic() < end:  # evaluation: a core busy, no step
            sum(range(10000))
        dog.beat(1, 1.0)
        print("survived", flush=True)
        began = time.monotonic()
        while True:  # a spinning wait that never ends
            sum(range(10000))
    """
    proc = watched_rank(tmp_path, body, floor_s=1.0, busy_cap_s=3.0)
    peer = Peer(proc)
    out, err = proc.communicate(timeout=120)
    peer.beating = False
    assert "survived" in out, (out, err)
    assert proc.returncode == EXIT_HUNG and "hung: no step progress for 5 s after step 2" in err, err


def test_a_sigstopped_rank_is_seen_by_the_next_one(tmp_path: Path) -> None:
    """A real SIGSTOP: rank 0's process (pulsing from its watchdog thread) is stopped; rank 1's
    watchdog ends rank 1 with the record naming rank 0."""
    code = textwrap.dedent("""
        import sys, threading
        from hpcrun.runtime.pulse import Pulse
        from hpcrun.runtime.watchdog import Watchdog
        from hpcrun.rundir import RunDir
        def gather(value):
            print(value, flush=True)
            return [value, sys.stdin.readline().strip()]
        pulse = Pulse(0, 2, 60.0, "127.0.0.1", gather, host="testhost")
        dog = Watchdog(RunDir(sys.argv[1]), "7", 0, 0, 2, timeout_s=600, pulse=pulse)
        dog.beat(0, 0.1)
        threading.Event().wait()
    """)
    zero = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "zero")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    one = watched_rank(tmp_path, "threading.Event().wait()\n", fixed="600")
    assert zero.stdin and zero.stdout and one.stdin and one.stdout
    theirs, mine = zero.stdout.readline().strip(), one.stdout.readline().strip()
    zero.stdin.write(mine + "\n")
    zero.stdin.flush()
    one.stdin.write(theirs + "\n")
    one.stdin.flush()
    try:
        time.sleep(3)
        assert one.poll() is None and zero.poll() is None
        os.kill(zero.pid, signal.SIGSTOP)
        _, err = one.communicate(timeout=60)
        assert one.returncode == EXIT_HUNG and "rank 0 on testhost silent for" in err, err
    finally:
        zero.kill()
        zero.wait()
