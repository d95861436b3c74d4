"""A submission whose answer is lost after SLURM accepted the job, on the real test cluster: the
next `hpcrun sweep`, `submit` or `resume` finds the job by its tag (`--comment=hpcrun:<tag>`)
and records it, and SLURM holds exactly one job. The lost answer is made by an `sbatch` earlier
on PATH that runs the real one (with `--hold`, so the job stays pending until the test cancels
it) and then kills hpcrun (`crash`), exits 1 with no output (`lost`), or submits nothing and
exits 1 (`none`)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import pytest
import yaml

from hpcrun.slurm import user
from tests import pool
from tests.helpers import ROOT
from tests.runs import recipe, site_copy

pytestmark = pytest.mark.cluster
NAMES = ("lostgrid", "lost", "crash", "none")  # the recipes' names: their jobs' names

LOSING_SBATCH = """#!/bin/bash
if [ "$LOSE" = none ]; then exit 1; fi
out=$(/usr/bin/sbatch --hold "$@") || exit $?
echo "${out%%;*}" >>"$SUBMITTED"
if [ "$LOSE" = crash ]; then kill -9 "$PPID"; fi
exit 1
"""


@pytest.fixture
def losing(tmp_path: Path) -> tp.Iterator[dict[str, str]]:
    """The environment of an hpcrun whose sbatch answers are lost; cancels what it submitted."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text(LOSING_SBATCH)
    (bindir / "sbatch").chmod(0o755)
    submitted = tmp_path / "submitted"
    submitted.touch()
    yield {"PATH": f"{bindir}:{os.environ['PATH']}", "SUBMITTED": str(submitted), "LOSE": "lost"}
    # by name in this pool's partition: also a second submission, were one made (it is not held)
    for name in NAMES:  # scancel takes one --name
        subprocess.run(["scancel", "-u", user(), "-p", pool.partition("batch"), "-n", name], check=True)


def hpcrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hpcrun.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, **(env or {})})


def submitted(env: dict[str, str]) -> list[str]:
    """The job ids the real sbatch gave (and hpcrun never saw)."""
    return Path(env["SUBMITTED"]).read_text().split()


def jobs_tagged(prefix: str, since: float) -> set[str]:
    """The jobs (array ids) submitted since `since` whose comment starts with `prefix`: the
    tags repeat between test runs, and slurmctld still shows an earlier run's cancelled jobs."""
    out = subprocess.run(["squeue", "-h", "-u", user(), "-t", "all", "-o", "%F|%V|%k"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = (line.split("|", 2) for line in out.stdout.splitlines())
    when = dt.datetime.fromisoformat
    return {job for job, at, text in rows if text.startswith(prefix) and when(at).timestamp() >= since}


def recorded(run_dir: Path) -> list[str]:
    return [job["job_id"] for job in json.loads((run_dir / "jobs.json").read_text())]


def test_sweep_after_a_crash_between_sbatch_and_ledger_finds_the_array(tmp_path: Path, losing: dict[str, str]) -> None:
    began = int(time.time())  # SLURM's submit times have whole seconds
    site = site_copy(tmp_path, "testcluster")
    grid = recipe(tmp_path, "lostgrid", training={"steps": 4}, sweep={"axes": {"training.lr": [0.001, 0.002]}})
    crashed = hpcrun("sweep", "--site", str(site), str(grid), env={**losing, "LOSE": "crash"})
    assert crashed.returncode == -9, crashed  # hpcrun died after SLURM took the array
    (array,) = submitted(losing)
    sweep_dir = next((tmp_path / "runs" / "sweeps").iterdir())
    points = json.loads((sweep_dir / "ledger.json").read_text())["points"]
    assert [p["state"] for p in points.values()] == ["submitting", "submitting"]
    assert not any("job_id" in p for p in points.values())

    again = hpcrun("sweep", "--site", str(site), str(grid))
    assert again.returncode == 0, again
    assert "submitted 0 point(s)" in again.stdout and again.stdout.count("  found ") == 2, again.stdout
    points = json.loads((sweep_dir / "ledger.json").read_text())["points"]
    assert sorted(p["job_id"] for p in points.values()) == [f"{array}_0", f"{array}_1"]
    run_dirs = [tmp_path / "runs" / p["run_id"] for p in points.values()]
    assert sorted(recorded(d)[-1] for d in run_dirs) == [f"{array}_0", f"{array}_1"]
    assert not any((d / "submitting.json").exists() for d in run_dirs)
    assert jobs_tagged(f"hpcrun:{sweep_dir.name}.", began) == {array}  # one array, not two

    third = hpcrun("sweep", "--site", str(site), str(grid))
    assert "submitted 0 point(s); 2 already submitted" in third.stdout, third
    # the point's job is still pending (held): resuming it would start a second writer
    resumed = hpcrun("resume", "--site", str(site), run_dirs[0].name)
    job = recorded(run_dirs[0])[-1]
    assert resumed.returncode == 2 and resumed.stderr.strip().count("\n") == 0, resumed
    assert f"job {job} of this run is still PENDING" in resumed.stderr, resumed.stderr
    assert jobs_tagged(f"hpcrun:{sweep_dir.name}.", began) == {array}


def test_submit_whose_answer_is_lost_records_the_real_job(tmp_path: Path, losing: dict[str, str]) -> None:
    began = int(time.time())
    site = site_copy(tmp_path, "testcluster")
    out = hpcrun("submit", "--site", str(site), "--run-id", "lost-answer", str(recipe(tmp_path, "lost")), env=losing)
    (job,) = submitted(losing)
    assert out.returncode == 0 and f"submitted lost-answer as job {job} " in out.stdout, out
    run_dir = tmp_path / "runs" / "lost-answer"
    assert recorded(run_dir) == [job] and not (run_dir / "submitting.json").exists()
    for again in (["submit", "--run-id", "lost-answer", str(recipe(tmp_path, "lost"))], ["resume", "lost-answer"]):
        refused = hpcrun(again[0], "--site", str(site), *again[1:], env=losing)
        assert refused.returncode == 2 and f"job {job} of this run is still PENDING" in refused.stderr, refused
    assert recorded(run_dir) == [job] and submitted(losing) == [job]
    assert jobs_tagged("hpcrun:lost-answer", began) == {job}


def test_resume_after_a_crash_between_sbatch_and_jobs_record(tmp_path: Path, losing: dict[str, str]) -> None:
    began = int(time.time())
    site = site_copy(tmp_path, "testcluster")
    args = ["submit", "--site", str(site), "--run-id", "crashed", str(recipe(tmp_path, "crash"))]
    crashed = hpcrun(*args, env={**losing, "LOSE": "crash"})
    assert crashed.returncode == -9, crashed
    (job,) = submitted(losing)
    run_dir = tmp_path / "runs" / "crashed"
    assert not (run_dir / "jobs.json").exists() and (run_dir / "submitting.json").exists()
    resumed = hpcrun("resume", "--site", str(site), "crashed")
    assert resumed.returncode == 2 and f"job {job} of this run is still PENDING" in resumed.stderr, resumed
    assert recorded(run_dir) == [job] and not (run_dir / "submitting.json").exists()
    assert jobs_tagged("hpcrun:crashed", began) == {job}


def test_a_lost_answer_with_no_job_is_not_sent_again_at_once(tmp_path: Path, losing: dict[str, str]) -> None:
    """sbatch fails with no word and SLURM has no job: the intent stays, and a second submission
    within the grace (an orphaned sbatch may still be answered) is refused, not sent."""
    began = int(time.time())
    site = site_copy(tmp_path, "testcluster")
    none = {**losing, "LOSE": "none"}
    out = hpcrun("submit", "--site", str(site), "--run-id", "no-answer", str(recipe(tmp_path, "none")), env=none)
    assert out.returncode == 2 and "SLURM shows no job with --comment=hpcrun:no-answer yet" in out.stderr, out
    run_dir = tmp_path / "runs" / "no-answer"
    assert (run_dir / "submitting.json").exists() and not (run_dir / "jobs.json").exists()
    again = hpcrun("resume", "--site", str(site), "no-answer")
    assert again.returncode == 2 and "an earlier submission of this run has no recorded answer" in again.stderr, again
    assert jobs_tagged("hpcrun:no-answer", began) == set() and submitted(losing) == []
    assert yaml.safe_load((run_dir / "submitting.json").read_text())["tag"] == "no-answer"
