"""Refusals that used to be tracebacks or quietly wrong: each is one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from click.testing import Result

from hpcrun.site import load_site
from tests.helpers import ROOT, cli
from tests.runs import site_copy
from tests.test_backend_fake import fake_tools


def one_line_refusal(result: Result, alone: bool = True) -> str:
    """The refusal: exit code 2 (click's own exit, not an exception escaping), no traceback, and
    one line, the last one (`alone`: the only one; doctor prints its findings so far first)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    if alone:
        assert len(lines) == 1, result.output
    return lines[-1]


@pytest.fixture
def bare_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding only a directory of fake SLURM tools (each written with bash builtins and
    absolute paths), so a tool left out is missing even on a machine where SLURM is installed."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    return bindir


SBATCH_THAT_COUNTS = 'echo "$@" >>"$FAKE_DIR/submitted"; echo 4242'


# --- hpcrun sweep without scontrol / sacctmgr ------------------------------------------------
@pytest.mark.parametrize("missing", ["scontrol", "sacctmgr"])
def test_sweep_without_slurm_tools_is_one_line(missing: str, bare_path: Path, tmp_path: Path) -> None:
    tools = {
        "sbatch": SBATCH_THAT_COUNTS,
        "scontrol": 'echo "MaxArraySize = 1001"',
        "sacctmgr": "exit 0",
        "squeue": "exit 0",
        "sacct": "exit 0",
    }
    del tools[missing]
    fake_tools(bare_path, **tools)
    site = site_copy(tmp_path, "testcluster")
    line = one_line_refusal(cli("sweep", "--site", str(site), "jobs/gpt-strategies.yaml"))
    assert line == f"Error: {missing} is not on PATH: this needs a SLURM login node"
    assert not (tmp_path / "submitted").exists()


def test_sweep_with_a_failing_scontrol_is_one_line(bare_path: Path, tmp_path: Path) -> None:
    fake_tools(
        bare_path,
        sbatch=SBATCH_THAT_COUNTS,
        scontrol='echo "slurm_load_ctl_conf error: Unable to contact slurm controller" >&2; exit 1',
    )
    site = site_copy(tmp_path, "testcluster")
    line = one_line_refusal(cli("sweep", "--site", str(site), "jobs/gpt-strategies.yaml"))
    assert line.startswith("Error: scontrol failed (read MaxArraySize for the sweep): slurm_load_ctl_conf error")
    assert not (tmp_path / "submitted").exists()


# --- SLURM tools that cannot run: not executable, hung -------------------------------------------
def test_sbatch_not_executable_is_one_line(bare_path: Path, tmp_path: Path) -> None:
    fake_tools(bare_path, sbatch=SBATCH_THAT_COUNTS)
    (bare_path / "sbatch").chmod(0o644)
    site = site_copy(tmp_path, "testcluster")
    line = one_line_refusal(cli("submit", "--site", str(site), "--run-id", "r-x", "jobs/quickstart.yaml"))
    why = "site 'testcluster-test' needs a SLURM login node"
    assert line == f"Error: sbatch is not executable ({bare_path}/sbatch): {why}"
    assert not (tmp_path / "runs" / "r-x").exists()  # nothing was sent: no run directory that looks live


def test_a_tool_not_executable_is_one_line_wherever_it_is_run(bare_path: Path, tmp_path: Path) -> None:
    """Past `require` (here status's sacct, never checked first): the same line, not a traceback."""
    fake_tools(bare_path, sacct="exit 0")
    (bare_path / "sacct").chmod(0o644)
    run_dir = fake_run(tmp_path / "runs", "r-1")
    (run_dir / "jobs.json").write_text(json.dumps([{"job_id": "7", "scheduler": "slurm"}]))
    line = one_line_refusal(cli("status", "--site", str(site_copy(tmp_path, "testcluster")), "r-1"))
    assert line == f"Error: sacct is not executable ({bare_path}/sacct): permission denied"


def test_a_hung_sbatch_is_one_line(bare_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hpcrun.slurm

    monkeypatch.setattr(hpcrun.slurm, "TIMEOUT_S", 1.0)  # hpcrun's own limit, shortened for the test
    fake_tools(bare_path, sbatch="exec /bin/sleep 60")
    site = site_copy(tmp_path, "testcluster")
    start = time.monotonic()
    line = one_line_refusal(cli("submit", "--site", str(site), "jobs/quickstart.yaml"))
    assert time.monotonic() - start < 20
    # its job may exist (hpcrun.backend looks it up by its tag; here squeue is missing too)
    assert line.startswith("Error: ") and "sbatch did not answer within 1 s: is slurmctld reachable?" in line, line
    assert "could not be looked up either (squeue is not on PATH" in line, line


# --- hpcrun logs of a dry run ----------------------------------------------------------------
@pytest.mark.parametrize("follow", [False, True])
def test_logs_of_a_dry_run_is_one_line(follow: bool, tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    assert cli("submit", "--dry-run", "--site", str(site), "--run-id", "dry", "jobs/quickstart.yaml").exit_code == 0
    line = one_line_refusal(cli("logs", "--site", str(site), "dry", *(["--follow"] if follow else [])))
    assert line == f"Error: {tmp_path}/runs/dry: no job was submitted for this run (a dry run?), so it has no logs"


def test_cancel_of_a_dry_run_is_one_line(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    assert cli("submit", "--dry-run", "--site", str(site), "--run-id", "dry", "jobs/quickstart.yaml").exit_code == 0
    line = one_line_refusal(cli("cancel", "--site", str(site), "dry"))
    assert "dry: no job was submitted for this run (a dry run?), so there is nothing to cancel" in line


# --- checkpoint consolidate --step N for a step that is not there ------------------------------
def test_consolidate_a_missing_step_is_one_line(tmp_path: Path) -> None:
    from hpcrun.rundir import MANIFEST, step_dir

    site = site_copy(tmp_path)
    assert cli("submit", "--dry-run", "--site", str(site), "--run-id", "ck", "jobs/quickstart.yaml").exit_code == 0
    run_dir = tmp_path / "runs" / "ck"
    line = one_line_refusal(cli("checkpoint", "consolidate", "--site", str(site), "ck", "--step", "4"))
    assert line == f"Error: {run_dir}: no complete checkpoint to consolidate"
    for step in (2, 6):
        path = step_dir(run_dir / "checkpoints", step)
        path.mkdir(parents=True)
        (path / MANIFEST).write_text(json.dumps({"complete": True, "step": step, "strategy": "ddp"}))
    line = one_line_refusal(cli("checkpoint", "consolidate", "--site", str(site), "ck", "--step", "4"))
    assert line == "Error: --step: no complete checkpoint at step 4 in ck (complete steps: 2, 6)"


# --- doctor without sacctmgr, and with a sinfo that hangs ----------------------------------------
def doctor_tools(bindir: Path, **override: str) -> None:
    tools = {
        "sbatch": 'echo "sbatch: Job 1 to start at now" >&2',
        "sacct": "exit 0",
        "scontrol": "exit 0",
        "sinfo": 'echo "batch|2|2|4000|(null)|1:00:00"; echo "urgent|2|2|4000|(null)|1:00:00"; '
        'echo "fragile|2|2|4000|(null)|1:00:00"; echo "spare|3|2|4000|(null)|1:00:00"',
        "sacctmgr": 'echo "acct|normal"',
    }
    tools.update(override)
    fake_tools(bindir, **{k: v for k, v in tools.items() if v is not None})


def test_doctor_fake_tools_pass(bare_path: Path, tmp_path: Path) -> None:
    """The fakes below answer like a healthy cluster, so the failures that follow are theirs."""
    doctor_tools(bare_path)
    site = site_copy(tmp_path, "testcluster", account="acct")
    result = cli("doctor", "--site", str(site), "--login-only")
    assert result.exit_code == 0, result.output
    assert "ok    partition batch: 2 nodes" in result.output and "ok    sbatch --test-only" in result.output


def test_doctor_without_sacctmgr_is_one_line(bare_path: Path, tmp_path: Path) -> None:
    doctor_tools(bare_path, sacctmgr=None)  # type: ignore[arg-type]
    site = site_copy(tmp_path, "testcluster", account="acct")
    line = one_line_refusal(cli("doctor", "--site", str(site), "--login-only"), alone=False)
    assert line == "Error: sacctmgr is not on PATH: this needs a SLURM login node"


def test_doctor_with_a_hung_sinfo_is_one_line(bare_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hpcrun.doctor

    monkeypatch.setattr(hpcrun.doctor, "TIMEOUT_S", 2.0)  # hpcrun's own limit, shortened for the test
    doctor_tools(bare_path, sinfo="exec /bin/sleep 60")
    site = site_copy(tmp_path, "testcluster")
    start = time.monotonic()
    line = one_line_refusal(cli("doctor", "--site", str(site), "--login-only"), alone=False)
    assert time.monotonic() - start < 20
    assert line == "Error: sinfo did not answer within 2 s: is slurmctld reachable?"


def test_doctor_with_a_failing_sinfo_is_a_finding(bare_path: Path, tmp_path: Path) -> None:
    doctor_tools(bare_path, sinfo='echo "sinfo: error: Unable to contact slurm controller" >&2; exit 1')
    site = site_copy(tmp_path, "testcluster")
    result = cli("doctor", "--site", str(site), "--login-only")
    assert result.exit_code == 1
    assert "fail  sinfo: sinfo: error: Unable to contact slurm controller" in result.output


# --- RUN: an ambiguous prefix is refused with the candidates; an exact id wins ---------------------
def fake_run(root: Path, name: str) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "runspec.json").write_text("{}")
    return run_dir


def test_ambiguous_prefix_lists_candidates(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    for name in ("20250101-aaaa-x", "20250101-bbbb-x", "20250102-cccc-x"):
        fake_run(tmp_path / "runs", name)
    for command in (["logs"], ["cancel"], ["resume"], ["status"], ["checkpoint", "consolidate"]):
        line = one_line_refusal(cli(*command, "--site", str(site), "20250101"))
        assert line == "Error: RUN: '20250101' matches 2 runs (20250101-aaaa-x, 20250101-bbbb-x); give one run id", (
            command,
            line,
        )
    # a unique prefix still names its run
    line = one_line_refusal(cli("logs", "--site", str(site), "20250102"))
    assert "runs/20250102-cccc-x: no job was submitted" in line


def test_exact_id_wins_over_longer_ids(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    for name in ("run", "run-2", "run-3"):
        fake_run(tmp_path / "runs", name)
    line = one_line_refusal(cli("logs", "--site", str(site), "run"))
    assert line == f"Error: {tmp_path}/runs/run: no job was submitted for this run (a dry run?), so it has no logs"


def test_sweep_id_names_its_runs_where_many_are_meant(bare_path: Path, tmp_path: Path) -> None:
    # cancel asks first whether each job has ended: job 11 still runs
    fake_tools(bare_path, scancel='echo "$@" >>"$FAKE_DIR/cancelled"', sacct='printf "11|RUNNING|node1|5|None\\n"')
    site = site_copy(tmp_path)
    for name in ("sw-1.p1", "sw-1.p2", "sw-10.p1"):
        fake_run(tmp_path / "runs", name)
    (tmp_path / "runs" / "sw-1.p1" / "jobs.json").write_text(json.dumps([{"job_id": "11", "scheduler": "slurm"}]))
    line = one_line_refusal(cli("logs", "--site", str(site), "sw-1"))  # one run wanted: which?
    assert line == "Error: RUN: 'sw-1' matches 3 runs (sw-1.p1, sw-1.p2, sw-10.p1); give one run id"
    # cancel takes every run of the sweep sw-1 (not sw-10): the one with a job is cancelled, the
    # others (dry runs) are named, in one scancel call
    out = cli("cancel", "--site", str(site), "sw-1")
    assert out.exit_code == 0, out.output
    assert "cancelled sw-1.p1 (job 11)" in out.output and "not cancelled sw-1.p2: no job was submitted" in out.output, (
        out.output
    )
    assert "sw-10" not in out.output
    assert (tmp_path / "cancelled").read_text() == "11\n"
    # nothing to cancel at all is still an error, one line
    line = one_line_refusal(cli("cancel", "--site", str(site), "sw-1.p2"))
    assert "sw-1.p2: no job was submitted for this run" in line, line


# --- validate: a site file that forgot `scheduler:` -----------------------------------------------
def test_site_without_scheduler_is_checked_as_a_site(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "sites" / "mycluster.yaml").read_text())
    del data["scheduler"]
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(data))
    line = one_line_refusal(cli("validate", str(site)))
    assert line == f"error {site}: scheduler: required"


# --- relative storage paths resolve against the site file, like template: --------------------------
def test_relative_storage_paths_resolve_against_the_site_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = yaml.safe_load((ROOT / "sites" / "local.yaml").read_text())
    data["storage"] = {"runs_dir": "runs", "results_dir": "../results", "nvme": {"path": "scratch/nvme", "size_gb": 1}}
    (tmp_path / "conf").mkdir()
    site_file = tmp_path / "conf" / "mine.yaml"
    site_file.write_text(yaml.safe_dump(data))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    site = load_site(str(site_file))
    assert site.storage.runs_dir == str(tmp_path / "conf" / "runs")
    assert site.storage.results_dir == str(tmp_path / "results")
    assert site.storage.nvme is not None and site.storage.nvme.path == str(tmp_path / "conf" / "scratch" / "nvme")
    # and given as a relative path from another directory, still the site file's directory
    monkeypatch.chdir(tmp_path)
    assert load_site("conf/mine.yaml").storage.runs_dir == str(tmp_path / "conf" / "runs")
    assert (
        load_site(str(ROOT / "sites" / "testcluster.yaml")).storage.runs_dir == "/var/tmp/hpcrun-testcluster/runs"
    )  # absolute stays


# --- the real controller answers the sweep's limit queries (a wrong sacctmgr argument is an error) --
@pytest.mark.cluster
def test_sweep_limits_from_the_real_cluster() -> None:
    from hpcrun import quota

    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    expected = next(
        int(line.split("=")[1]) for line in config.splitlines() if line.split("=")[0].strip() == "MaxArraySize"
    )
    # root's association sets no MaxSubmitJobs and its default QOS (normal) no per-user cap
    assert quota.limits(None, None, ["batch"]) == (expected, None)
    # QOS capped (tests/cluster/testcluster.sh) holds 10 jobs per user, whoever asks
    size, cap = quota.limits(None, "capped", ["batch"])
    assert cap is not None and (cap.where, cap.cap) == ("QOS capped's MaxSubmitJobsPerUser", 10), cap


def test_status_with_a_failing_squeue_is_one_line(bare_path: Path, tmp_path: Path) -> None:
    """Without accounting, status falls back to squeue; a squeue that fails must not turn every
    run into LEFT_QUEUE."""
    fake_tools(
        bare_path,
        sacct='echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1',
        squeue='echo "squeue: error: Unable to contact slurm controller (connect failure)" >&2; exit 1',
    )
    site = site_copy(tmp_path, "testcluster")
    run_dir = fake_run(tmp_path / "runs", "r1")
    (run_dir / "jobs.json").write_text(json.dumps([{"job_id": "12", "scheduler": "slurm"}]))
    line = one_line_refusal(cli("status", "--site", str(site), "r1"))
    assert line == "Error: squeue failed: squeue: error: Unable to contact slurm controller (connect failure)"


# --- a checkpoint manifest that cannot be read is an error, not "no checkpoint" -------------------
def test_a_manifest_this_user_may_not_read_is_an_error() -> None:
    """EACCES itself (root reads everything, so the reader runs as uid 65534): the newest
    manifest is named as unreadable, never skipped for the older checkpoint."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from hpcrun.rundir import MANIFEST, step_dir
    from tests.slurmstats import run_as

    root = Path(tempfile.mkdtemp(prefix="hpcrun-eacces-")) / "checkpoints"
    try:
        root.parent.chmod(0o755)
        for step in (2, 4):
            step_dir(root, step).mkdir(parents=True)
            (step_dir(root, step) / MANIFEST).write_text(json.dumps({"complete": True, "step": step}))
        (step_dir(root, 4) / MANIFEST).chmod(0o000)
        code = "import sys, pathlib, hpcrun.runtime.checkpoint as c; print(c.latest(pathlib.Path(sys.argv[1])))"
        out = subprocess.run(
            [*run_as("65534"), sys.executable, "-c", code, str(root)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(root.parent)},
            timeout=120,
        )
        assert out.returncode != 0 and "CorruptStateError" in out.stderr, (out.returncode, out.stdout, out.stderr)
        named = f"{step_dir(root, 4) / MANIFEST}: corrupt state file, refusing to guess its content (unreadable: "
        assert named in out.stderr and "Permission denied" in out.stderr, out.stderr
        assert "step-00000002" not in out.stdout
    finally:
        shutil.rmtree(root.parent)


def test_an_unreadable_manifest_is_an_error_not_an_older_checkpoint(tmp_path: Path) -> None:
    """Only a missing manifest means incomplete. One that cannot be read (here a directory where
    the file should be: EISDIR, as EIO, EACCES or ESTALE would be on a shared filesystem) or
    parsed names the file; it used to be skipped, and resume took step 2 without a word."""
    from hpcrun.rundir import MANIFEST, CorruptStateError, step_dir
    from hpcrun.runtime.checkpoint import complete, latest

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        step_dir(root, step).mkdir(parents=True)
    (step_dir(root, 2) / MANIFEST).write_text(json.dumps({"complete": True, "step": 2}))
    step_dir(root, 6).mkdir()  # being written: no manifest yet
    assert latest(root) == (2, step_dir(root, 2))
    (step_dir(root, 4) / MANIFEST).mkdir()
    with pytest.raises(CorruptStateError, match=f"{step_dir(root, 4) / MANIFEST}.*unreadable"):
        complete(root)
    (step_dir(root, 4) / MANIFEST).rmdir()
    (step_dir(root, 4) / MANIFEST).write_text('{"complete": tr')
    with pytest.raises(CorruptStateError, match="not JSON"):
        latest(root)
