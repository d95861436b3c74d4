"""What ended a job step first: which rank, on which node, and how, read from srun's messages
and the ranks' own exit records.

When one rank dies, the others fail a moment later ("Connection closed by peer") or are killed
by srun (`--kill-on-bad-exit`); none of them knows who died first. srun's own messages
("srun: error: node2: task 3: Killed") say which task ended first.

Pure text: imports nothing of hpcrun's (it runs on the batch node after srun).
"""

from __future__ import annotations

import dataclasses
import re
import typing as tp

# srun's message when a task ends badly, e.g. "srun: error: node2: task 3: Killed" or
# "srun: error: node1: tasks 0-1: Exited with exit code 1"
SRUN_ERROR = re.compile(r"srun: error: (?P<node>[^:\s]+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+)")
SIGNAL_WORDS = {
    "Killed": "SIGKILL", "Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Terminated": "SIGTERM",
    "Bus error": "SIGBUS", "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL",
}
# slurmstepd's word when the step was ended from outside, e.g. "*** STEP 12.0 ON node1 CANCELLED AT
# 2024-01-01T00:00:00 DUE TO TIME LIMIT ***": the step id and the time differ every attempt
STEP_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT \S+(?P<why> DUE TO [^*]+?)? \*\*\*")
# what a rank reports when it only saw another one go (the cause is elsewhere)
CONSEQUENCE = re.compile(r"closed by peer|reset by peer|Broken pipe|Connection refused", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Failure:
    """What ended an attempt first: a rank (and its node) and how it ended."""

    rank: int | None
    node: str | None
    what: str  # "Killed (SIGKILL)", "exit code 1", "RuntimeError: ..."
    step: int | None  # the step it failed in, when the rank said so

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "the job step"
        where = f" on {self.node}" if self.node else ""
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{who}{where}: {self.what}{at}"


def step_message(srun_stderr: str) -> str | None:
    """What srun or slurmstepd said of a step no task message explains: "CANCELLED DUE TO TIME
    LIMIT", or srun's last error line."""
    cancelled = list(STEP_CANCELLED.finditer(srun_stderr))
    if cancelled:
        return "CANCELLED" + (cancelled[-1]["why"] or "")
    errors = [line.strip() for line in srun_stderr.splitlines() if "error" in line.lower()]
    return errors[-1] if errors else None


def first_ranks(tasks: str) -> list[int]:
    """The ranks of srun's task list ("0-1,3"), in its order."""
    out: list[int] = []
    for part in tasks.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def first_failure(srun_stderr: str, records: list[dict[str, tp.Any]]) -> Failure | None:
    """Which rank ended the attempt: srun's messages in the order the tasks ended, told apart
    from ranks that only saw a peer go; each rank's own record adds its error and step."""
    by_rank = {int(r["rank"]): r for r in records}
    candidates: list[Failure] = []
    for match in SRUN_ERROR.finditer(srun_stderr):
        what = match["what"].strip()
        code = re.fullmatch(r"Exited with exit code (\d+)", what)
        for rank in first_ranks(match["tasks"]):
            rec = by_rank.get(rank)
            if rec is not None:
                candidates.append(Failure(rank, match["node"], rec["error"], rec.get("step")))
            elif code:
                candidates.append(Failure(rank, match["node"], f"exit code {code[1]}", None))
            else:
                candidates.append(
                    Failure(
                        rank, match["node"], f"{what} ({SIGNAL_WORDS[what]})" if what in SIGNAL_WORDS else what, None
                    )
                )
    for rec in sorted(records, key=lambda r: r.get("time", 0)):  # ranks srun did not name
        if all(c.rank != rec["rank"] for c in candidates):
            candidates.append(Failure(int(rec["rank"]), rec.get("node"), rec["error"], rec.get("step")))
    causes = [c for c in candidates if not CONSEQUENCE.search(c.what)]
    found = causes or candidates
    return found[0] if found else None
