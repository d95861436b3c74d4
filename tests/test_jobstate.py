"""Job states in one table (hpcrun.jobstate), and everyone reading it: status, counts, `--wait`
and its `--timeout`. Fake `sacct`s stand in for the scheduler (parsing only)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpcrun import jobstate
from hpcrun.jobstate import Phase
from hpcrun.progress import counts_line
from hpcrun.status import statuses
from tests.helpers import cli
from tests.runs import site_copy
from tests.test_backend_fake import fake_tools, tools  # noqa: F401 (a fixture)

# every state SLURM 22.05-24.x prints (slurm.h's job_state_string and its flags)
SLURM_STATES = """BOOT_FAIL CANCELLED COMPLETED COMPLETING CONFIGURING DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY
PENDING PREEMPTED REQUEUED REQUEUE_FED REQUEUE_HOLD RESIZING REVOKED RUNNING SIGNALING SPECIAL_EXIT STAGE_OUT
STOPPED SUSPENDED TIMEOUT""".split()


def test_the_table_holds_every_slurm_state_and_hpcrun_s_own() -> None:
    assert set(SLURM_STATES) <= set(jobstate.TABLE)
    assert set(jobstate.TABLE) - set(SLURM_STATES) == {
        "UNKNOWN", "LEFT_QUEUE", "RESUMABLE", "SUBMITTING", "PREEMPTED_CANCELLED"}
    assert all(s.meaning for s in jobstate.TABLE.values())


@pytest.mark.parametrize("name, phase", [
    ("SUSPENDED", Phase.ACTIVE), ("STOPPED", Phase.ACTIVE),  # paused with the allocation: not finished
    ("PREEMPTED", Phase.RETURNING), ("REQUEUED", Phase.RETURNING),  # SLURM runs it again
    ("PREEMPTED_CANCELLED", Phase.FAILED),  # preempted where PreemptMode=CANCEL (hpcrun.status reads it)
    ("REQUEUE_HOLD", Phase.PENDING), ("SPECIAL_EXIT", Phase.PENDING),
    ("REVOKED", Phase.FAILED), ("DEADLINE", Phase.FAILED), ("BOOT_FAIL", Phase.FAILED),
    ("CANCELLED by 0", Phase.FAILED),
    ("COMPLETED", Phase.SUCCEEDED), ("COMPLETING", Phase.ACTIVE), ("STAGE_OUT", Phase.ACTIVE),
    ("SOMETHING_NEW", Phase.ACTIVE),  # a newer SLURM's word: waited on, never resubmitted
])
def test_what_a_state_means(name: str, phase: Phase) -> None:
    assert jobstate.phase(name) is phase
    assert jobstate.done(name) == (phase in (Phase.SUCCEEDED, Phase.FAILED))


def run_dir(tmp_path: Path, name: str, job: str, state: dict[str, object] | None = None) -> Path:
    path = tmp_path / "runs" / name
    path.mkdir(parents=True)
    (path / "runspec.json").write_text("{}")
    (path / "jobs.json").write_text(json.dumps([{"job_id": job, "scheduler": "slurm", "submitted": 0}]))
    if state:
        (path / "state.json").write_text(json.dumps({**state, "job_id": job}))
    return path


SACCT = ('printf "1|SUSPENDED|node1|5|None\\n2|PREEMPTED|node1|5|None\\n3|REVOKED||0|None\\n'
         '4|STOPPED|node1|5|None\\n5|COMPLETED|node1|5|None\\n6|COMPLETED|node1|5|None\\n"')


def test_status_and_counts_read_the_table(tools: Path, tmp_path: Path) -> None:  # noqa: F811
    fake_tools(tools, sacct=SACCT)
    dirs = [run_dir(tmp_path, f"run{j}", str(j)) for j in range(1, 6)]
    # the batch script ended well but the attempt stopped and was not requeued: resumable
    dirs.append(run_dir(tmp_path, "run6", "6", {"status": "stopped", "attempt": 0}))
    result = {s.run_id: s for s in statuses(dirs)}
    assert [result[f"run{j}"].done for j in range(1, 7)] == [False, False, True, False, True, True]
    assert result["run6"].state == "RESUMABLE"
    assert counts_line(list(result.values())) == "done 1  running 2  pending 1  failed 2"


def test_wait_timeout_is_one_line_and_its_own_exit_status(tools: Path, tmp_path: Path) -> None:  # noqa: F811
    """A STOPPED (SIGSTOPped) job has not ended: `--wait` keeps following it until `--timeout`."""
    fake_tools(tools, sacct='printf "4|STOPPED|node1|5|None\\n"')
    run_dir(tmp_path, "stopped", "4")
    site = site_copy(tmp_path, "testcluster")
    start = time.monotonic()
    out = cli("status", "--site", str(site), "--wait", "--timeout", "2", "stopped")
    took = time.monotonic() - start
    assert out.exit_code == 124, (out.exit_code, out.output)
    assert 2 <= took < 10, took
    assert out.stderr.strip().splitlines()[-1] == (
        "Error: --timeout 2 s passed with 1 of 1 runs not ended (stopped: STOPPED); the jobs go on"), out.stderr
    assert "Traceback" not in out.output


def test_wait_ends_without_timeout_once_runs_end(tools: Path, tmp_path: Path) -> None:  # noqa: F811
    fake_tools(tools, sacct='printf "5|CANCELLED by 0|node1|5|None\\n"')
    site = str(site_copy(tmp_path, "testcluster"))
    assert cli("submit", "--dry-run", "--site", site, "--run-id", "cancelled", "jobs/quickstart.yaml").exit_code == 0
    (tmp_path / "runs" / "cancelled" / "jobs.json").write_text(json.dumps([{"job_id": "5", "scheduler": "slurm"}]))
    out = cli("status", "--site", site, "--wait", "--timeout", "30", "cancelled")
    assert out.exit_code == 1, out.output  # ended, not completed: a failed run's status, not the timeout's


def test_timeout_without_wait_is_refused(tmp_path: Path) -> None:
    out = cli("status", "--site", str(site_copy(tmp_path, "testcluster")), "--timeout", "3")
    assert out.exit_code == 2 and out.output.strip() == "Error: --timeout: --timeout only bounds --wait", out.output


def test_a_run_whose_sbatch_answer_was_lost_shows_as_submitting(tmp_path: Path) -> None:
    """Only an intent (submitting.json), no job recorded: `hpcrun status` names the run and says
    what happens next, rather than leaving it out as if it were a dry run."""
    from tests.helpers import cli

    run_dir = tmp_path / "lost-1"
    run_dir.mkdir()
    (run_dir / "runspec.json").write_text("{}")
    (run_dir / "submitting.json").write_text(json.dumps({"tag": "lost-1", "at": 1.0, "script": "x.sh"}))
    out = cli("status", str(run_dir))
    assert out.exit_code == 0, out.output
    assert "lost-1" in out.output and "SUBMITTING" in out.output and "looks the job up" in out.output, out.output
