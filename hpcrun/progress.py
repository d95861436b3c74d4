"""A run's live progress as people watching it see it: rank 0's `progress.json` read into a typed
`Progress`, the few words `status` shows for it, and the two displays of `--wait` (a tqdm bar per
run on a terminal, a plain line now and then into a log).

Login side only: imports neither torch nor the runtime that writes the file."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import typing as tp
from pathlib import Path

from hpcrun import jobstate
from hpcrun.rundir import CorruptStateError, RunDir, current_names, read_json, write_json

PLAIN_INTERVAL_S = 30.0  # a log or CI page wants a line now and then, not one per poll
FALLBACK_COLUMNS, FALLBACK_ROWS = 100, 40


@dataclasses.dataclass(frozen=True)
class Progress:
    """What rank 0 last said of its training (progress.json). `eta_s` is as of `updated`."""

    step: int
    total: int
    updated: float
    job_id: str = ""
    attempt: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    eta_s: float | None = None
    checkpoint_step: int | None = None
    saves: tuple[str, ...] = ()
    """How the attempt spaces its checkpoints and snapshots and what they cost, a line each (hpcrun.cadence)."""

    @property
    def percent(self) -> float | None:
        return 100.0 * self.step / self.total if self.total > 0 else None

    def eta_now(self, now: float) -> float | None:
        """Seconds left from `now`: the writer's estimate less the time since it wrote it."""
        return None if self.eta_s is None else max(0.0, self.eta_s - max(0.0, now - self.updated))


_INTS = ("step", "total", "attempt", "checkpoint_step")
_FLOATS = ("updated", "loss", "tokens_per_s", "step_time_s", "eta_s")
_REQUIRED = ("step", "total", "updated")


def parse(path: Path, value: tp.Any) -> Progress:
    """`value` (progress.json's JSON) checked field by field; a wrong one is a CorruptStateError
    naming the file and the field. Unknown fields are ignored: the writer may add some."""
    if not isinstance(value, dict):
        raise CorruptStateError(path, "not a JSON object")
    value = current_names(value)  # written by an older hpcrun
    fields: dict[str, tp.Any] = {}
    for name in _REQUIRED:
        if value.get(name) is None:
            raise CorruptStateError(path, f"field {name!r} missing")
    for name in _INTS:
        got = value.get(name)
        if got is not None and (isinstance(got, bool) or not isinstance(got, int)):
            raise CorruptStateError(path, f"field {name!r} is not an integer (got {got!r})")
        if got is not None:
            fields[name] = got
    for name in _FLOATS:
        got = value.get(name)
        if got is not None and (isinstance(got, bool) or not isinstance(got, (int, float))):
            raise CorruptStateError(path, f"field {name!r} is not a number (got {got!r})")
        if got is not None:
            fields[name] = float(got)
    if value.get("job_id") is not None:
        fields["job_id"] = str(value["job_id"])
    saves = value.get("saves") or []
    if not isinstance(saves, list) or not all(isinstance(line, str) for line in saves):
        raise CorruptStateError(path, f"field 'saves' is not a list of lines (got {saves!r})")
    fields["saves"] = tuple(saves)
    return Progress(**fields)


def write(
    path: Path,
    step: int,
    total: int | None,
    loss: float | None,
    tokens_per_s: float | None,
    step_time_s: float | None,
    job_id: str,
    attempt: int,
    checkpoint_step: int | None,
    saves: tp.Sequence[str] = (),
) -> None:
    """progress.json as the job writes it (the built-in loop and a command's reported steps):
    the newest step, its rate and the time left at that rate, and how saves are spaced."""
    write_json(path, {
        "step": step, "total": total, "loss": loss, "tokens_per_s": tokens_per_s, "step_time_s": step_time_s,
        "eta_s": (total - step) * step_time_s if total and step_time_s is not None else None, "updated": time.time(),
        "job_id": job_id, "attempt": attempt, "checkpoint_step": checkpoint_step, "saves": list(saves),
    })


def typical_step_s(times: tp.Iterable[float]) -> float | None:
    """The step time progress.json shows: the median of `times` (the upper one of an even
    count), which one slow step (a checkpoint save) does not move; None for no times."""
    ordered = sorted(times)
    return ordered[len(ordered) // 2] if ordered else None


def read(run_dir: Path) -> Progress | None:
    """The run's progress, or None before rank 0 first wrote it. The writer replaces the file
    atomically, so a file that does not parse is corrupt, not half-written: refused."""
    path = RunDir(run_dir).progress
    value = read_json(path, None)
    return None if value is None else parse(path, value)


# words -------------------------------------------------------------------------------------
def duration(seconds: float | None) -> str:
    """`m:ss`, `h:mm:ss`, or `Nd hh:mm` past a day; empty when unknown."""
    if seconds is None:
        return ""
    whole = int(round(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}:{minutes:02d}"
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def rate(tokens_per_s: float | None) -> str:
    """Tokens per second in three significant figures: `950`, `12.3k`, `1.25M`."""
    if tokens_per_s is None:
        return ""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.3g}{suffix}"
    return f"{tokens_per_s:.0f}"


class RunStatus(tp.Protocol):
    """What the displays read of where a run stands (hpcrun.status.RunStatus is one): a shape,
    so this module, which hpcrun.status imports for `Progress`, does not import it back."""

    @property
    def run_id(self) -> str: ...
    @property
    def job_id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def requeues(self) -> int: ...
    @property
    def in_job(self) -> int: ...
    @property
    def progress(self) -> Progress | None: ...
    @property
    def done(self) -> bool: ...


def requeues_note(status: RunStatus) -> str:
    """` (requeues 1, 2 in the job)`: requeues and restarts inside the job, when there were any."""
    parts = ([f"requeues {status.requeues}"] if status.requeues else []) + (
        [f"{status.in_job} in the job"] if status.in_job else []
    )
    return f" ({', '.join(parts)})" if parts else ""


def live(status: RunStatus) -> bool:
    """Whether the progress speaks for the job now running (not a previous submission's last
    word, nor a finished run whose ETA means nothing)."""
    p = status.progress
    return p is not None and status.state == jobstate.RUNNING and p.job_id in ("", status.job_id)


def words(status: RunStatus, now: float) -> list[str]:
    """Progress in words for one line: step, loss, rate and ETA (the last two only while live)."""
    p = status.progress
    if p is None:
        return []
    shown = [f"step {p.step}/{p.total}" + (f" ({p.percent:.0f}%)" if p.percent is not None else "")]
    if p.loss is not None:
        shown.append(f"loss {p.loss:.4f}")
    if live(status):
        if p.tokens_per_s is not None:
            shown.append(f"{rate(p.tokens_per_s)} tok/s")
        if p.eta_s is not None:
            shown.append(f"ETA {duration(p.eta_now(now))}")
    if p.checkpoint_step is not None:
        shown.append(f"ckpt {p.checkpoint_step}")
    return shown


def line(status: RunStatus, now: float) -> str:
    """One plain line for a run: `<run>: RUNNING step 40/100 (40%), loss 3.2101, ...`."""
    head = f"{status.run_id}: {status.state}" + requeues_note(status)
    shown = words(status, now)
    return head + (" " + ", ".join(shown) if shown else "")


# --wait displays -----------------------------------------------------------------------------
class Display(tp.Protocol):
    def show(self, current: tp.Sequence[RunStatus]) -> None: ...

    def close(self) -> None: ...


class PlainLines:
    """For a log or a pipe: a line for a run when its state or requeues change, when its
    progress first appears and first moves (people want to see it start training), and then at
    most every `interval` s while its step moves."""

    def __init__(self, out: tp.TextIO, interval: float = PLAIN_INTERVAL_S) -> None:
        self.out, self.interval = out, interval
        self.seen: dict[str, tuple[str, int]] = {}
        self.printed: dict[str, tuple[float, int | None]] = {}  # when, at which step
        self.first: dict[str, int] = {}  # the step its progress started from
        self.moved: set[str] = set()  # runs already shown past that step

    def show(self, current: tp.Sequence[RunStatus]) -> None:
        now = time.time()
        for status in current:
            run, step = status.run_id, (status.progress.step if status.progress else None)
            if step is not None:
                self.first.setdefault(run, step)
            printed_at, printed_step = self.printed.get(run, (0.0, None))
            changed = self.seen.get(run) != (status.state, status.requeues)
            due = step != printed_step and (run not in self.moved or now - printed_at >= self.interval)
            if changed or due:
                print(line(status, now), file=self.out, flush=True)
                self.seen[run] = (status.state, status.requeues)
                self.printed[run] = (now, step)
                if step is not None and step != self.first[run]:
                    self.moved.add(run)

    def close(self) -> None:
        self.out.flush()


class Bars:
    """For a terminal: one tqdm bar per run (step of total, loss, tokens/s, ETA from the run's own
    estimate), redrawn when its progress or state changes."""

    FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{postfix}"
    WAITING = "{desc}{postfix}"

    def __init__(self, out: tp.TextIO) -> None:
        self.out = out
        self.bars: dict[str, tp.Any] = {}
        self.drawn: dict[str, tuple[tp.Any, ...]] = {}

    def _bar(self, run_id: str) -> tp.Any:
        from tqdm import tqdm

        if run_id not in self.bars:
            size: dict[str, tp.Any] = (
                {"dynamic_ncols": True} if _sized(self.out) else {"ncols": FALLBACK_COLUMNS, "nrows": FALLBACK_ROWS}
            )
            self.bars[run_id] = tqdm(
                total=None,
                position=len(self.bars),
                file=self.out,
                leave=True,
                bar_format=self.WAITING,
                mininterval=0,
                **size,
            )
        return self.bars[run_id]

    def show(self, current: tp.Sequence[RunStatus]) -> None:
        now = time.time()
        for status in current:
            bar, p = self._bar(status.run_id), status.progress
            eta = p.eta_now(now) if p is not None and live(status) else None
            key = (status.state, status.requeues, p, None if eta is None else int(eta))
            if self.drawn.get(status.run_id) == key:
                continue
            self.drawn[status.run_id] = key
            head = f"{status.run_id} {status.state}" + requeues_note(status)
            bar.set_description_str(head, refresh=False)
            if p is not None:
                if bar.total != p.total:
                    bar.total, bar.bar_format = p.total, self.FORMAT
                bar.n = p.step
                bar.set_postfix_str(", ".join(words(status, now)[1:]), refresh=False)
            bar.refresh()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def _sized(out: tp.TextIO) -> bool:
    """Whether the terminal says its size. A pseudo-terminal nobody sized says 0 x 0, and tqdm
    then hides every bar (0 columns wide, past the last of 0 rows)."""
    try:
        size = os.get_terminal_size(out.fileno())
    except (OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0


class Counts:
    """For many runs (a campaign): one line of how many are done, running, pending and failed
    when those numbers change, at most every GAP_S seconds (a bar or a line per run of
    thousands helps nobody)."""

    GAP_S = 5.0

    def __init__(self, out: tp.TextIO) -> None:
        self.out = out
        self.said, self.when = "", 0.0
        self.current: tp.Sequence[RunStatus] = []

    def show(self, current: tp.Sequence[RunStatus]) -> None:
        self.current = current
        text = counts_line(current)
        if text != self.said and (not self.said or time.time() - self.when >= self.GAP_S):
            print(f"{len(current)} runs: {text}", file=self.out, flush=True)
            self.said, self.when = text, time.time()

    def close(self) -> None:
        """The last counts, if a change came within the gap and was not shown."""
        if self.current and counts_line(self.current) != self.said:
            print(f"{len(self.current)} runs: {counts_line(self.current)}", file=self.out, flush=True)
        self.out.flush()


# a requeued job waits in the queue again: pending, like one never started
COUNTED = {jobstate.Phase.SUCCEEDED: "done", jobstate.Phase.FAILED: "failed", jobstate.Phase.ACTIVE: "running",
           jobstate.Phase.PENDING: "pending", jobstate.Phase.RETURNING: "pending"}


def counts_line(current: tp.Sequence[RunStatus]) -> str:
    """`done N  running N  pending N  failed N` of runs."""
    counts = dict.fromkeys(("done", "running", "pending", "failed"), 0)
    for r in current:
        counts[COUNTED[jobstate.phase(r.state)]] += 1
    return "  ".join(f"{k} {n}" for k, n in counts.items())


MANY_RUNS = 20  # beyond this many runs, --wait shows counts, not a bar or a line per run


def display(out: tp.TextIO | None = None, runs: int = 1) -> Display:
    """Bars when `out` (stderr by default) is a terminal, plain lines otherwise; counts for more
    than MANY_RUNS runs."""
    out = out or sys.stderr
    if runs > MANY_RUNS:
        return Counts(out)
    return Bars(out) if out.isatty() else PlainLines(out)
