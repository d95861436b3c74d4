"""Parsing of what SLURM's tools say about a submission whose answer may be lost, with the tools
faked at the process boundary (the real lost answer is in test_cluster_submission.py)."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest

from hpcrun import slurm
from hpcrun.errors import SubmissionError
from tests.test_backend_fake import fake_tools, tools  # noqa: F401 (the fixture)

FAILED = "sbatch: error: Batch job submission failed"


def stamp(seconds_ago: float) -> str:
    return dt.datetime.fromtimestamp(time.time() - seconds_ago).strftime("%Y-%m-%dT%H:%M:%S")


def printed(rows: list[str]) -> str:
    """A fake tool's body that prints `rows`, one a line."""
    return "printf '%s\\n' " + " ".join(repr(row) for row in rows)


@pytest.mark.parametrize(
    ("said", "lost"),
    [
        (f'echo "{FAILED}: Socket timed out on send/recv operation" >&2; exit 1', True),
        ("exit 1", True),
        ('echo "Submitted batch job"', True),
        (f'echo "{FAILED}: Invalid account or account/partition combination specified" >&2; exit 1', False),
    ],
)
def test_an_unclear_sbatch_answer_is_lost_a_refusal_is_not(
    tools: Path, tmp_path: Path, said: str, lost: bool  # noqa: F811
) -> None:
    fake_tools(tools, sbatch=said)
    with pytest.raises(SubmissionError) as caught:
        slurm.sbatch(tmp_path / "script.sh")
    assert isinstance(caught.value, slurm.LostAnswer) is lost, caught.value.message


def test_an_sbatch_that_does_not_answer_in_time_is_a_lost_answer(tools: Path, tmp_path: Path) -> None:  # noqa: F811
    fake_tools(tools, sbatch="sleep 5; echo 42")
    with pytest.raises(slurm.LostAnswer, match="did not answer within 1 s"):
        slurm.sbatch(tmp_path / "script.sh", timeout=1)


def test_tagged_jobs_match_tag_and_script_in_squeue_then_sacct(tools: Path) -> None:  # noqa: F811
    """squeue: the tag with another run's script is not ours. sacct (comments not stored): the
    script at the end of the SubmitLine, only for jobs submitted since the intent."""
    squeue_rows = [
        f"70|{stamp(5)}|hpcrun:r1|/runs/other/r1/script.sh",  # the same run id in another runs directory
        f"71|{stamp(5)}|hpcrun:r1|/runs/a/r1/script.sh",
        f"72|{stamp(5)}|(null)|/runs/a/r2/script.sh",
    ]
    sacct_rows = [
        f"40_[0-1]|{stamp(3600)}||sbatch --parsable /runs/a/r2/script.sh",  # before the intent
        f"73_0|{stamp(5)}||sbatch --parsable /runs/a/r2/script.sh",
        f"73_1|{stamp(5)}||sbatch --parsable /runs/a/r2/script.sh",
        f"74|{stamp(5)}|hpcrun:someone-else|sbatch --parsable /runs/a/r3/script.sh",
    ]
    fake_tools(tools, squeue=printed(squeue_rows), sacct=printed(sacct_rows))
    scripts = {"r1": "/runs/a/r1/script.sh", "r2": "/runs/a/r2/script.sh", "r3": "/runs/a/r3/script.sh"}
    assert slurm.tagged_jobs(scripts, time.time() - 60) == {"r1": ["71"], "r2": ["73"]}
