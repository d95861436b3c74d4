"""Parsing and fallbacks of the SLURM seam, with the scheduler's command-line tools faked at
the process boundary (the real cluster is in test_cluster.py)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from hpcrun.status import parse_sacct, statuses
from tests.helpers import cli
from tests.runs import site_copy


def fake_tools(bindir: Path, **scripts: str) -> None:
    bindir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bindir / name
        path.write_text("#!/bin/bash\n" + body + "\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.log"))
    fake_tools(bindir, srun="exit 0")
    return bindir


def test_parse_sacct_counts_requeues() -> None:
    text = (
        "41|PREEMPTED|node[1-2]|30|None\n41|REQUEUED|node[1-2]|10|None\n41|RUNNING|node1|5|None\n"
        "42|CANCELLED by 0|node2|7|None\n"
    )
    rows = parse_sacct(text)
    assert rows["41"].state == "RUNNING" and rows["41"].records == 3 and rows["41"].nodes == "node1"
    assert rows["42"].state == "CANCELLED" and rows["42"].elapsed_s == 7


def test_submit_sends_the_rendered_script(tools: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tools(tools, sbatch='echo "$@" >>"$FAKE_LOG"; cp "${@: -1}" "$FAKE_LOG.script"; echo "4242;hpctest"')
    site = site_copy(tmp_path, "testcluster")
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    out = cli("submit", "--site", str(site), "--run-id", "r-fixed", "jobs/quickstart.yaml")
    assert out.exit_code == 0, out.output
    assert "as job 4242" in out.output
    rendered = cli("render", "--site", str(site), "--run-id", "r-fixed", "jobs/quickstart.yaml").stdout
    assert Path(f"{tmp_path}/calls.log.script").read_text() == rendered
    run_dir = tmp_path / "runs" / "r-fixed"
    assert json.loads((run_dir / "jobs.json").read_text())[0]["job_id"] == "4242"
    assert (run_dir / "script.sh").read_text() == rendered


def test_refused_submission_leaves_no_run_dir(tools: Path, tmp_path: Path) -> None:
    fake_tools(
        tools,
        sbatch=(
            'echo "sbatch: error: Batch job submission failed: '
            'Invalid account or account/partition combination specified" >&2; exit 1'
        ),
    )
    site = site_copy(tmp_path, "testcluster")
    out = cli("submit", "--site", str(site), "--run-id", "r-refused", "jobs/quickstart.yaml")
    assert out.exit_code == 1
    assert "Invalid account or account/partition combination specified" in out.output
    assert out.output.strip().count("\n") == 0
    assert not (tmp_path / "runs" / "r-refused").exists()


def test_missing_sbatch_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    site = site_copy(tmp_path, "testcluster")
    out = cli("submit", "--site", str(site), "jobs/quickstart.yaml")
    assert out.exit_code == 2  # the site's setup, like every SLURM tool that cannot run (hpcrun.slurm)
    assert out.output.strip() == "Error: sbatch is not on PATH: site 'testcluster-test' needs a SLURM login node"


def _run_dir(tmp_path: Path, name: str, job: str, state: dict | None = None) -> Path:
    run_dir = tmp_path / "runs" / name
    run_dir.mkdir(parents=True)
    (run_dir / "runspec.json").write_text("{}")
    (run_dir / "jobs.json").write_text(json.dumps([{"job_id": job, "scheduler": "slurm", "submitted": 0}]))
    if state:
        (run_dir / "state.json").write_text(json.dumps({**state, "job_id": job}))
    return run_dir


def test_status_is_one_sacct_call(tools: Path, tmp_path: Path) -> None:
    fake_tools(
        tools,
        sacct=(
            'echo "sacct $*" >>"$FAKE_LOG"; printf "7|COMPLETED|node[1-2]|61|None\\n8|PREEMPTED|node1|5|None\\n'
            '8|RUNNING|node2|9|None\\n9|PENDING||0|Priority\\n"'
        ),
    )
    dirs = [_run_dir(tmp_path, f"run{j}", str(j)) for j in (7, 8, 9)]
    result = {s.run_id: s for s in statuses(dirs)}
    calls = Path(tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 1 and "-j 7,8,9" in calls[0]
    assert result["run7"].state == "COMPLETED" and result["run7"].elapsed_s == 61
    assert result["run8"].state == "RUNNING" and result["run8"].requeues == 1
    assert result["run9"].state == "PENDING" and result["run9"].reason == "Priority"


def test_status_falls_back_without_accounting(tools: Path, tmp_path: Path) -> None:
    fake_tools(
        tools,
        sacct='echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1',
        squeue='echo "squeue $*" >>"$FAKE_LOG"; echo "12|RUNNING|node1|1:05|None"',
    )
    running = _run_dir(tmp_path, "running", "12")
    finished = _run_dir(tmp_path, "finished", "11", {"status": "completed", "attempt": 2})
    gone = _run_dir(tmp_path, "gone", "10")
    result = {s.run_id: s for s in statuses([running, finished, gone])}
    assert result["running"].state == "RUNNING" and result["running"].elapsed_s == 65
    assert result["finished"].state == "COMPLETED" and result["finished"].requeues == 2
    assert result["gone"].state == "LEFT_QUEUE"
    assert all("accounting disabled" in s.source for s in result.values())
    out = cli("status", "--site", str(site_copy(tmp_path, "testcluster")))
    assert "squeue+markers (accounting disabled)" in out.output


def test_job_ids_are_compressed_one_argument_per_array() -> None:
    from hpcrun.slurm import compress_ids

    assert compress_ids(["7", "9_0", "9_1", "9_2", "9_5", "10_3"]) == ["7", "9_[0-2,5]", "10_3"]
    assert compress_ids([f"4_{i}" for i in reversed(range(1000))]) == ["4_[0-999]"]
