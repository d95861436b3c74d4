"""Watching runs while they train: `hpcrun status` shows step of total, %, tokens/s, ETA, newest
checkpoint and restarts from rank 0's progress.json; `--wait` shows a bar per run on a terminal
and a plain line now and then without one.

The first tests write progress.json themselves (the format the runtime writes) beside a live
process; the `slow` and `cluster` ones read what a real training job writes."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import pytest

from hpcrun.progress import Counts, PlainLines, Progress, display
from hpcrun.status import RunStatus
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT, cli
from tests.runs import hpcrun, recipe, run_dir_of, site_copy, state

# `STEP % TOK/S ETA` of a status line that shows a live run: `12/60   20  1.05k     0:14`. TOK/S
# is empty for a user's entrypoint job (hpcrun does not know its tokens per step).
LIVE = re.compile(
    r" (?P<step>\d+)/(?P<total>\d+) +(?P<percent>\d+) +(?:(?P<rate>[\d.]+[kMG]?) +)?(?P<eta>\d+:\d\d(?::\d\d)?)\b"
)
TRAINING = {"lr": 0.003, "micro_batch": 2, "seq_len": 32}


def progress_file(run_dir: Path, **fields: object) -> None:
    value = {
        "step": 40, "total": 100, "loss": 3.25, "tokens_per_s": 12345.0, "step_time_s": 0.5, "eta_s": 600.0,
        "updated": time.time(), "job_id": "1", "attempt": 0, "checkpoint_step": 35,
    }
    value.update(fields)
    (run_dir / "progress.json").write_text(json.dumps(value))


def local_run(runs: Path, name: str, pid: int, submitted: float) -> Path:
    run_dir = runs / name
    run_dir.mkdir(parents=True)
    (run_dir / "runspec.json").write_text("{}")
    (run_dir / "jobs.json").write_text(json.dumps([{"job_id": str(pid), "scheduler": "local", "submitted": submitted}]))
    return run_dir


@pytest.fixture
def sleeper() -> tp.Iterator[int]:
    """A live process standing in for a local job's controller."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_status_of_a_running_local_run_reads_its_progress(tmp_path: Path, sleeper: int) -> None:
    run_dir = local_run(tmp_path / "runs", "r-live", sleeper, time.time() - 125)
    progress_file(run_dir, job_id=str(sleeper), attempt=2)
    out = cli("status", str(run_dir))
    assert out.exit_code == 0, out.output
    header, line = out.stdout.splitlines()
    assert header.split()[5:11] == ["REQUEUES", "IN-JOB", "STEP", "%", "TOK/S", "ETA"], header
    fields = line.split()
    assert fields[:3] == ["r-live", str(sleeper), "RUNNING"]
    assert fields[4] in ("2:05", "2:06", "2:07")  # ELAPSED of a local run: from jobs.json's submit time
    assert fields[5:7] == ["2", "0"]  # requeues: the running attempt's, from its progress; none in the job
    match = LIVE.search(line)
    assert match and (match["step"], match["total"], match["percent"], match["rate"]) == ("40", "100", "40", "12.3k"), (
        line
    )
    assert match["eta"] in ("9:59", "10:00", "9:58"), line
    assert fields[-1] == "35"  # newest complete checkpoint


def test_progress_of_an_earlier_job_shows_no_rate_or_eta(tmp_path: Path, sleeper: int) -> None:
    """A resumed run waiting for its new job: the old job's last step stays, its ETA does not."""
    run_dir = local_run(tmp_path / "runs", "r-old", sleeper, time.time())
    progress_file(run_dir, job_id="4242")
    line = cli("status", str(run_dir)).stdout.splitlines()[1]
    assert "40/100" in line and not LIVE.search(line) and "12.3k" not in line, line


def test_a_sweep_keeps_its_counts_line(tmp_path: Path, sleeper: int) -> None:
    runs = tmp_path / "runs"
    for index in range(3):
        progress_file(local_run(runs, f"sw.{index}", sleeper, time.time()), job_id=str(sleeper), step=10 * index)
    (local_run(runs, "sw.3", 2**22 + 12345, time.time()) / "state.json").write_text(
        json.dumps({"status": "completed", "job_id": str(2**22 + 12345)})
    )
    out = cli("status", "--site", str(site_copy(tmp_path)), "sw")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0] == "done 1  running 3  pending 0  failed 0"
    assert sorted(LIVE.search(text)["step"] for text in lines[2:5]) == ["0", "10", "20"]  # type: ignore[index]


def test_a_corrupt_progress_file_is_one_line_naming_it(tmp_path: Path, sleeper: int) -> None:
    run_dir = local_run(tmp_path / "runs", "r-bad", sleeper, time.time())
    progress_file(run_dir, step="forty")
    out = cli("status", str(run_dir))
    assert out.exit_code == 2 and isinstance(out.exception, SystemExit), (out.exit_code, out.output)
    (line,) = out.output.strip().splitlines()
    assert "progress.json" in line and "'step' is not an integer" in line, line


def test_plain_lines_come_on_changes_and_at_an_interval() -> None:
    out = io.StringIO()
    lines = PlainLines(out, interval=0.3)

    def poll(state: str, step: int | None) -> None:
        p = (
            None
            if step is None
            else Progress(step=step, total=50, updated=time.time(), job_id="7", eta_s=5.0, tokens_per_s=900.0)
        )
        lines.show([RunStatus("r", "7", state, progress=p)])

    poll("PENDING", None)
    poll("RUNNING", None)
    for step in range(0, 11):  # eleven polls in well under the interval: the start and first move only
        poll("RUNNING", step)
    time.sleep(0.35)
    poll("RUNNING", 11)  # the interval passed and the step moved
    time.sleep(0.35)
    poll("RUNNING", 11)  # the interval passed, the step did not move
    poll("COMPLETED", 50)
    assert out.getvalue().splitlines() == [
        "r: PENDING",
        "r: RUNNING",
        "r: RUNNING step 0/50 (0%), 900 tok/s, ETA 0:05",
        "r: RUNNING step 1/50 (2%), 900 tok/s, ETA 0:05",
        "r: RUNNING step 11/50 (22%), 900 tok/s, ETA 0:05",
        "r: COMPLETED step 50/50 (100%)",
    ]


def test_many_runs_show_counts_not_a_line_each() -> None:
    """A campaign's --wait: one line of counts when they change (at most every GAP_S s), not a
    bar or a line per run."""
    out = io.StringIO()
    shown = display(out, runs=300)
    assert isinstance(shown, Counts)
    shown.GAP_S = 2.0

    def poll(done: int) -> None:
        shown.show([RunStatus(f"r{i}", str(i), "COMPLETED" if i < done else "PENDING") for i in range(300)])

    poll(0)
    poll(0)  # unchanged: nothing
    poll(1)  # changed, but within the gap: nothing yet
    time.sleep(2.1)
    poll(2)
    assert out.getvalue().splitlines() == [
        "300 runs: done 0  running 0  pending 300  failed 0",
        "300 runs: done 2  running 0  pending 298  failed 0",
    ]
    assert isinstance(display(io.StringIO(), runs=3), PlainLines)


# real jobs ---------------------------------------------------------------------------------
def delayed(tmp_path: Path, name: str, steps: int, delay_s: float) -> Path:
    """A job that lasts at least steps x delay_s on any CPU, checkpointing every 5 steps."""
    return recipe(
        tmp_path, name, job=entrypoint_job(str(ROOT), delay_s), training={"steps": steps, **TRAINING},
        checkpoint={"interval": 5}, resources={"nodes": 1, "gpus_per_node": 2, "time": "00:10:00"},
    )


def status_line(site: Path, run_dir: Path) -> str:
    return next(
        text
        for text in hpcrun("status", "--site", str(site), run_dir.name).stdout.splitlines()
        if text.startswith(run_dir.name)
    )


def live_line(site: Path, run_dir: Path, timeout: float = 180) -> re.Match[str]:
    """Poll `hpcrun status` until the run shows live progress past step 0; that status match."""
    deadline = time.time() + timeout
    line = ""
    while time.time() < deadline:
        line = status_line(site, run_dir)
        match = LIVE.search(line)
        if match and int(match["step"]) > 0:
            assert line.split()[2] == "RUNNING", line
            return match
        assert line.split()[2] in ("PENDING", "RUNNING", "CONFIGURING", "UNKNOWN"), line  # UNKNOWN: not in sacct yet
        time.sleep(0.5)
    raise AssertionError(f"no live progress in `hpcrun status` after {timeout} s: {line}")


@pytest.mark.slow
def test_status_of_a_running_local_job(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(delayed(tmp_path, "live", 60, 0.3))))  # >= 18 s
    try:
        match = live_line(site, run_dir)
        assert match["total"] == "60" and 0 < int(match["step"]) < 60 and match["eta"] != "0:00", match.group(0)
        line = status_line(site, run_dir)
        assert re.match(r"\d+:\d\d", line.split()[4]), line  # ELAPSED, from jobs.json's submit time
    finally:
        hpcrun("cancel", "--site", str(site), run_dir.name)


def terminal_run(args: list[str], timeout: float = 300) -> tuple[int, str]:
    """Run hpcrun under a pseudo-terminal of 120 x 40 (stdin, stdout and stderr on it): exit
    status and everything it drew."""
    import fcntl
    import struct
    import termios

    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrun.cli", *args], cwd=ROOT, stdin=child, stdout=child, stderr=child, close_fds=True
    )
    os.close(child)
    drawn = b""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if select.select([parent], [], [], 1)[0]:
            try:
                chunk = os.read(parent, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        elif proc.poll() is not None:
            break
    os.close(parent)
    return proc.wait(timeout=max(1.0, deadline - time.time())), drawn.decode(errors="replace")


@pytest.mark.slow
def test_wait_on_a_terminal_draws_a_bar_that_advances(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    code, drawn = terminal_run(
        ["submit", "--site", str(site), "--wait", str(delayed(tmp_path, "bar", 20, 0.4))]
    )  # >= 8 s
    assert code == 0, drawn
    steps = {
        int(m[1]) for m in re.finditer(r"%\|[^|]*\| (\d+)/20, loss \d", drawn)
    }  # a tqdm bar: `40%|████   | 8/20, loss ...`
    assert len(steps & set(range(1, 20))) >= 2 and 20 in steps, (steps, drawn[-2000:])
    assert re.search(r"\| \d+/20, loss [\d.]+, ETA \d+:\d\d", drawn), drawn[-2000:]  # no tok/s: a user's job


@pytest.mark.slow
def test_wait_without_a_terminal_prints_plain_lines(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    start = time.time()
    out = hpcrun("submit", "--site", str(site), "--wait", str(delayed(tmp_path, "plain", 20, 0.4)))
    elapsed, lines = time.time() - start, out.stderr.splitlines()
    assert "\r" not in out.stderr and "%|" not in out.stderr, out.stderr
    assert any(re.search(r": RUNNING step \d+/20 \(\d+%\), loss [\d.]+, ETA \d+:\d\d", text) for text in lines), (
        out.stderr
    )
    assert any(re.search(r": COMPLETED step 20/20 \(100%\), loss [\d.]+", text) for text in lines), out.stderr
    # state changes, the start, the first move and one per 30 s: not a line per poll (one a second)
    assert len(lines) <= 4 + elapsed // 30, (elapsed, out.stderr)
    assert state(run_dir_of(out))["status"] == "completed"


@pytest.mark.cluster
def test_status_of_a_running_cluster_job(tmp_path_factory: pytest.TempPathFactory) -> None:
    shared = tmp_path_factory.mktemp("cluster")  # both nodes see it
    site = site_copy(shared, "testcluster")
    run_dir = run_dir_of(
        hpcrun("submit", "--site", str(site), str(delayed(shared, "live-cluster", 60, 0.3)))
    )  # >= 18 s
    try:
        match = live_line(site, run_dir)
        assert match["total"] == "60" and 0 < int(match["step"]) < 60 and match["eta"] != "0:00", match.group(0)
        status = hpcrun("status", "--site", str(site), run_dir.name)
        assert "(from sacct)" in status.stderr
    finally:
        hpcrun("cancel", "--site", str(site), run_dir.name)
