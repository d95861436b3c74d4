"""The expected failure rate learned, not guessed: a node's MTBF on a partition from the site's own
results (every failed attempt is a row, with its cause), and a job's from its own failures so far.

Both estimates count the prior as one pseudo-failure: with a prior of `P` hours per failure, `f`
failures seen in `E` hours of exposure give MTBF = (P + E) / (1 + f). A short history barely moves
the prior (no failure in 100 node-hours against 5,000: 5,100 h), a long one dominates it (100
failures in 100,000 node-hours: 1,040 h, near the history's 1,000), and one early failure cannot send
the estimate to a few hours (it halves it at most), which would have every job save far too often.
A job's own second failure in one allocation is different evidence: one job's failures come in bursts
(a flaky node or link, a failing disk, a bad batch of hosts), which a prior of thousands of hours would
take hundreds of failures to see, so from then on its MTBF is that allocation's seconds trained per
failure when that is shorter (a requeue, on other nodes, starts afresh). A wrong guess costs little: no
kind of save takes more than `checkpoint.overhead` of the time.

`learn`, `machine_failure`, `in_job_history` and `tightened` are pure; `resolve` reads the site's
results directory (submission and `hpcrun plan`). Imports no torch; pandas only once there are rows.
"""

from __future__ import annotations

import dataclasses
import re
import typing as tp
from pathlib import Path

if tp.TYPE_CHECKING:
    import pandas as pd

    from hpcrun.plan import RunSpec

PRIOR = "the site's node_mtbf_hours"
"""The source of a node MTBF nothing was learned for: the partition's `node_mtbf_hours` (hpcrun.site)."""

COLUMNS = ["attempt_id", "cluster", "partition", "nodes", "start_time", "end_time", "status", "reason", "job_kind"]
"""The results columns the estimate reads (the rest of a row is not loaded)."""

# A failed row that is not the machine's failure: the job's own error, or a stop a cap made final.
NOT_THE_MACHINE = re.compile(
    r"the call's own error"  # a function job's call raised (hpcrun.runtime.failure)
    # the same error at the same step again: deterministic, the code's or the data's
    r"|the same failure as the previous attempt"
    r"|^(?:requeue|timeout) cap reached"  # a stop (time limit, preemption) past a cap (hpcrun.runtime.attempt)
    r"|\bCANCELLED(?! DUE TO NODE)"  # slurmstepd ended the step: time limit, preemption, scancel
    # a bad recipe, or a programming error in the user's code; an out-of-memory is the recipe's size
    r"|\b(?:HpcrunError|ValidationError|SyntaxError|ImportError|ModuleNotFoundError|NameError|AttributeError"
    r"|TypeError|ValueError|KeyError|IndexError|AssertionError|NotImplementedError|ZeroDivisionError"
    r"|OutOfMemoryError)\b|out of memory"
)
# a rank that exited with a status of its own and left no record: a command job's script failed
EXIT_CODE = re.compile(r": exit code \d+")


def machine_failure(status: tp.Any, reason: tp.Any, job_kind: tp.Any = None) -> bool:
    """Whether a results row is a failure of the machine: a failed attempt whose rank was killed
    or hung, whose node was lost, whose step failed. Not the job's own error (a call that raised,
    a bad recipe, a programming error, the same failure again), nor a stop (time limit, preemption,
    a cancel) that a cap or SLURM turned into a failure; completed, stopped and requeued rows are
    exposure only."""
    if status != "failed":
        return False
    text = reason if isinstance(reason, str) else ""
    if NOT_THE_MACHINE.search(text):
        return False
    return not (job_kind == "command" and EXIT_CODE.search(text))


@dataclasses.dataclass(frozen=True)
class Learned:
    """A node's MTBF on one partition, and its evidence."""

    partition: str
    prior_hours: float
    """The site's node MTBF (`node_mtbf_hours`): one pseudo-failure in that many node-hours."""
    failures: int
    """Failed attempts the machine caused (`machine_failure`)."""
    node_hours: float
    """Exposure: each attempt's wall time times its nodes, all attempts on the partition. An attempt
    whose start no one recorded (a rank killed before it wrote its row) adds none: the estimate errs
    short, towards more frequent saves."""
    attempts: int

    @property
    def node_mtbf_hours(self) -> float:
        return (self.prior_hours + self.node_hours) / (1 + self.failures)

    def source(self) -> str:
        """Where the figure came from, in words (`hpcrun plan`, runspec.json)."""
        if not self.attempts:
            return f"{PRIOR} (no results of partition {self.partition} yet)"
        return (
            f"learned on partition {self.partition} from {_count(self.failures, 'failure')} in "
            f"{self.node_hours:.0f} node-hours of {_count(self.attempts, 'attempt')} "
            f"(prior {self.prior_hours:g} h per node)"
        )


def learn(rows: pd.DataFrame, partition: str, prior_hours: float, cluster: str | None = None) -> Learned:
    """A node's MTBF on `partition` (of `cluster`, when given: a results directory may hold other
    sites' rows) from the site's results rows (`hpcrun.results.load`'s columns; `COLUMNS` is enough):
    (prior_hours + node-hours of every attempt) / (1 + failures the machine caused). Pure."""
    import numpy as np
    import pandas as pd

    def where(column: str, value: str) -> tp.Any:
        return rows[column].astype("object").eq(value).to_numpy(dtype=bool)

    # a row that names no cluster (written before the column was) is taken as the directory's own site's
    ours = (where("cluster", cluster) | rows["cluster"].isna().to_numpy(dtype=bool)) if cluster is not None else True
    mine = rows[where("partition", partition) & ours]
    failed = mine[mine["status"].astype("object").eq("failed").to_numpy(dtype=bool)]  # the few read row by row
    kinds = failed["job_kind"] if "job_kind" in failed.columns else [None] * len(failed)
    failures = sum(machine_failure("failed", r, k) for r, k in zip(failed["reason"], kinds))
    start, end = (pd.to_datetime(mine[c], utc=True) for c in ("start_time", "end_time"))
    hours = ((end - start).dt.total_seconds() / 3600).to_numpy(dtype=float, na_value=float("nan"))
    nodes = pd.to_numeric(mine["nodes"], errors="coerce").to_numpy(dtype=float, na_value=float("nan"))
    exposure = hours.clip(min=0) * nodes
    node_hours = float(np.nansum(exposure))  # NaN (no start, no nodes) adds nothing
    return Learned(partition, prior_hours, int(failures), node_hours, len(mine))


def in_job_history(starts: tp.Sequence[str]) -> tuple[int, float]:
    """A job's own failures so far and the seconds trained before them, from the batch script's
    line per start of its training step (hpcrun.rundir's `starts`: `<SLURM_RESTART_COUNT>
    <restarts in the job> <epoch seconds> <nodes>`). A start with restarts in the job follows a
    failure; the attempt before it trained from its own start to that one. An attempt that ended in
    a requeue left no end here and adds nothing (nor does a failure that was requeued). Pure."""
    parsed: list[tuple[int, float]] = []
    for line in starts:
        fields = line.split(" ")  # not split(): SLURM_RESTART_COUNT is empty before the first requeue
        try:
            parsed.append((int(fields[1]), float(fields[2])))
        except (IndexError, ValueError):
            continue
    failures, trained = 0, 0.0
    for (_, before), (restarts, at) in zip(parsed, parsed[1:]):
        if restarts > 0:
            failures += 1
            trained += max(0.0, at - before)
    return failures, trained


BURST = 2
"""A job's own failures from which its own rate, when higher, is its MTBF (above)."""


def this_allocation(starts: tp.Sequence[str]) -> list[str]:
    """The lines of `starts` (`in_job_history`'s) of the job's current allocation: those with the
    last line's SLURM_RESTART_COUNT (a requeue starts another, often on other nodes). Pure."""
    if not starts:
        return []
    current = starts[-1].split(" ")[0]
    return [line for line in starts if line.split(" ")[0] == current]


def tightened(planned_s: float, failures: int, trained_s: float, burst: tuple[int, float] = (0, 0.0)) -> float:
    """The job's MTBF in seconds with its own `failures` in `trained_s`: the plan's as one pseudo-
    failure (after one failure its Young/Daly intervals are about sqrt(2) times shorter), and, when
    `burst` (failures, seconds trained: this allocation's, `this_allocation`) counts `BURST` or more,
    its seconds trained per failure when fewer (at least a second). Pure."""
    pooled = (planned_s + trained_s) / (1 + failures)
    near, near_s = burst
    return pooled if near < BURST else min(pooled, max(1.0, near_s / near))


_cache: dict[str, tuple[tuple[str, ...], pd.DataFrame]] = {}


def site_rows(results_dir: str | Path) -> pd.DataFrame | None:
    """The `COLUMNS` of every results row in `results_dir`, None when it holds none. Only those
    columns are read (a login node with a long history reads a few MB, not every measurement), and
    once per process while the directory's files stay the same (results files are never rewritten:
    a new attempt or a compaction adds names), so a sweep's points share one read. A bad file is
    skipped with a warning, as `hpcrun.results.load` skips it."""
    from hpcrun import results

    for tries in range(3):
        paths = results.files(results_dir)
        if not paths:
            return None
        key = tuple(str(p) for p in paths)
        cached = _cache.get(str(results_dir))
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            data = _read(key)
        except results.Vanished:  # a compaction merged them meanwhile: list again
            if tries == 2:
                raise
            continue
        frame = data.to_pandas().drop_duplicates("attempt_id")  # compaction briefly leaves copies
        _cache[str(results_dir)] = (key, frame)
        return frame
    raise AssertionError("unreachable")


def _read(paths: tuple[str, ...]) -> tp.Any:
    import pyarrow as pa
    import pyarrow.dataset as ds

    from hpcrun import results

    try:  # a dataset with the schema reads only these columns, and nulls where an older file lacks one
        data = ds.dataset(list(paths), schema=results.SCHEMA, format="parquet").to_table(columns=COLUMNS)
        if data.column("attempt_id").null_count:
            raise ValueError("rows without attempt_id")  # a file not ours: the careful read skips it
        return data
    except (pa.ArrowException, OSError, ValueError):
        return results.read([Path(p) for p in paths]).select(COLUMNS)


def resolve(spec: RunSpec) -> RunSpec:
    """`spec` with the node MTBF its partition's history gives (`learn`) and where it came from,
    for submission and `hpcrun plan`. The recipe's `fault.mtbf_hours` needs nothing learned; a
    results directory with no rows of the partition leaves the site's prior; one that cannot be
    read leaves it too, with the reason, and never stops a submission."""
    if spec.recipe.fault.mtbf_hours:
        return spec
    prior = spec.partition_spec.node_mtbf_hours
    try:
        rows = site_rows(spec.results_dir)
        learned = learn(rows, spec.partition, prior, spec.cluster) if rows is not None else None
    except Exception as exc:  # whatever is wrong with the history, the job is submitted on the prior
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return spec.model_copy(
            update={"node_mtbf_hours": None, "mtbf_source": f"{PRIOR} (results in {spec.results_dir} unread: {why})"}
        )
    if learned is None:
        return spec.model_copy(update={"node_mtbf_hours": None, "mtbf_source": f"{PRIOR} (no results yet)"})
    value = learned.node_mtbf_hours if learned.attempts else None
    return spec.model_copy(update={"node_mtbf_hours": value, "mtbf_source": learned.source()})


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
