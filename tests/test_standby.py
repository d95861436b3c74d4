"""The warm standby's side of its protocol with the batch script (hpcrun.runtime.standby): a line
each on stdin. The batch script's side runs on the test cluster (tests/test_cluster_in_job.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import typing as tp

from hpcrun.runtime import standby
from hpcrun.signals import SignalFlag
from tests.helpers import ROOT


def bounded(call: tp.Callable[[], tp.Any], timeout: float = 20) -> tp.Any:
    """`call()`'s result, failing (not hanging) when it has none within `timeout` s."""
    done: list[tp.Any] = []
    thread = threading.Thread(target=lambda: done.append(call()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert done, f"no answer within {timeout} s"
    return done[0]


def told(*chunks: bytes, flag: SignalFlag | None = None) -> tuple[int | None, list[str]]:
    """What `standby.wait` answers to `chunks` written on its stdin one after the other (then the
    pipe left open), and the warm-ups it did."""
    read, write = os.pipe()
    warmed: list[str] = []
    for chunk in chunks:
        os.write(write, chunk)
    try:
        answer = bounded(lambda: standby.wait(flag or SignalFlag(), read, warm=lambda: warmed.append("warm") or 0.0))
        return answer, warmed
    finally:
        os.close(write)
        os.close(read)


def test_go_after_warm_runs_and_warms_once() -> None:
    assert told(b"warm\n", b"warm\n", b"go\n") == (None, ["warm"])


def test_lines_sent_together_are_each_seen() -> None:
    """Two lines in one read (the batch script's `warm` then `go` close together)."""
    assert told(b"warm\ngo\n") == (None, ["warm"])


def test_go_unwarmed_warms_first() -> None:
    assert told(b"go\n") == (None, ["warm"])


def test_exit_and_end_of_input_end_it() -> None:
    """`exit`: status 0; the end of its input (srun or the batch script gone): UNTOLD, so that a standby
    taken for the restart as it left fails the step instead of passing for a completed one."""
    assert told(b"warm\nexit\n") == (0, ["warm"])
    read, write = os.pipe()
    os.close(write)
    try:
        assert bounded(lambda: standby.wait(SignalFlag(), read, warm=lambda: 0.0)) == standby.UNTOLD
    finally:
        os.close(read)


def test_a_stop_signal_ends_the_wait() -> None:
    """A requeue's or a cancel's signal (the flag set) ends a waiting standby within its poll."""
    flag = SignalFlag()
    read, write = os.pipe()
    threading.Timer(0.2, lambda: setattr(flag, "signum", 15)).start()
    began = time.monotonic()
    try:
        assert bounded(lambda: standby.wait(flag, read, warm=lambda: 0.0)) == standby.UNTOLD
    finally:
        os.close(write)
        os.close(read)
    assert time.monotonic() - began < standby.POLL_S + 2


def test_go_gives_up_stdin() -> None:
    """A rank reads nothing on stdin: after `go` its descriptor is /dev/null, not the pipe."""
    read, write = os.pipe()
    os.write(write, b"go\n")
    mine = os.dup(read)
    try:
        assert bounded(lambda: standby.wait(SignalFlag(), mine, warm=lambda: 0.0)) is None
        assert os.readlink(f"/proc/self/fd/{mine}") == os.devnull
    finally:
        for fd in (mine, read, write):
            os.close(fd)


def launched(stdin: str) -> subprocess.CompletedProcess[str]:
    """`python -m hpcrun.launch RUN_DIR` as a standby, told `stdin`: whether it imported torch."""
    code = ("import sys, hpcrun.launch as launch; rc = launch.main(['no-such-run']); "
            "print('torch' in sys.modules, rc)")
    return subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, standby.ENV: "1"}, timeout=120)


def test_a_dismissed_standby_exits_without_importing_torch() -> None:
    out = launched("exit\n")
    assert out.returncode == 0 and out.stdout.split() == ["False", "0"], out


def test_a_warmed_standby_has_torch_imported_before_go() -> None:
    out = launched("warm\nexit\n")
    assert out.returncode == 0 and out.stdout.split() == ["True", "0"], out
    assert "[hpcrun] standby: warm in " in out.stderr, out.stderr
