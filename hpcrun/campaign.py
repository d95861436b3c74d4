"""Submitting a sweep: plan every point, then, holding the sweep's ledger lock from reading to
recording, submit only the points not yet submitted (and, if asked, those that failed), as job
arrays of points that render to the same script. Concurrent invocations submit each point once.

State on disk is checked before anything is sent: a corrupt ledger, or a point's run directory
whose jobs or state file cannot be read, stops the sweep with one line and submits nothing.
A point left "submitting" (sbatch's answer lost) is looked up in SLURM by its array's tag first
(hpcrun.backend.settle): found, its job is recorded; not found, it is sent again.
"""

from __future__ import annotations

import dataclasses
import time
import typing as tp
from pathlib import Path

from hpcrun import backend, jobstate, quota, render
from hpcrun.errors import HpcrunError
from hpcrun.ledger import Ledger
from hpcrun.memory import misfit
from hpcrun.plan import RunSpec, plan_point
from hpcrun.recipe import RecipeFile
from hpcrun.rundir import LOGS, RunDir, sweep_dir
from hpcrun.site import Site
from hpcrun.status import statuses, wait
from hpcrun.sweep import describe, expand, point_id, sweep_id


@dataclasses.dataclass(frozen=True)
class Point:
    point_id: str
    overrides: dict[str, tp.Any]
    spec: RunSpec | None
    skipped: str | None = None

    @property
    def label(self) -> str:
        return describe(self.overrides)


def points(site: Site, recipe_file: RecipeFile, sid: str) -> list[Point]:
    """Every point, planned on `site`; one that cannot run there is kept with the reason."""
    assert recipe_file.sweep is not None
    result = []
    for overrides in expand(recipe_file.sweep):
        pid = point_id(overrides)
        try:
            spec = plan_point(site, recipe_file, sid, overrides)
            reason = misfit(spec)
            result.append(Point(pid, overrides, None if reason else spec, reason))
        except HpcrunError as exc:
            result.append(Point(pid, overrides, None, exc.message.split(": ", 1)[-1]))
    return result


def arrays(
    specs: list[RunSpec], max_array_size: int, headroom: int | None, key: tp.Callable[[RunSpec], str] = render.array_key
) -> tuple[list[list[RunSpec]], list[RunSpec]]:
    """(chunks to submit as arrays, points deferred for lack of room under the submit cap,
    hpcrun.quota): points grouped by the script they render to (`key`), each group split to stay
    under MaxArraySize."""
    groups: dict[str, list[RunSpec]] = {}
    for spec in specs:
        groups.setdefault(key(spec), []).append(spec)
    chunks: list[list[RunSpec]] = []
    deferred: list[RunSpec] = []
    budget = headroom
    for group in groups.values():
        for start in range(0, len(group), max_array_size):
            chunk = group[start : start + max_array_size]
            if budget is not None:
                chunk, rest = chunk[:budget], chunk[budget:]
                deferred.extend(rest)
                budget -= len(chunk)
            if chunk:
                chunks.append(chunk)
    return chunks, deferred


@dataclasses.dataclass
class Outcome:
    sweep_id: str
    directory: Path
    submitted: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (point, job)
    arrays: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)  # (array spec, points)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (label, reason)
    deferred: list[str] = dataclasses.field(default_factory=list)
    cap: str | None = None  # the job cap SLURM applies (hpcrun.quota), when one does
    already: int = 0
    scripts: list[str] = dataclasses.field(default_factory=list)
    found: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (point, job): a lost answer SLURM had
    waiting: list[str] = dataclasses.field(default_factory=list)  # a lost answer too recent to send again


def check_run_dirs(all_points: list[Point]) -> None:
    """Read every planned point's jobs and state files, so a corrupt one stops the sweep here,
    before the first submission, instead of halfway through it (CorruptStateError)."""
    for p in all_points:
        if p.spec is not None:
            run_dir = RunDir(p.spec.run_dir)
            run_dir.jobs()
            run_dir.state()


def reconcile(ledger: Ledger, all_points: list[Point], outcome: Outcome) -> backend.Settled:
    """Points sent earlier whose answer was not recorded (sbatch's answer lost, or hpcrun stopped
    between sbatch and the ledger): the job SLURM holds under the submission's tag, or the one
    their run directory recorded, goes into the ledger. Points SLURM has no job for stay in the
    state "submitting"; `settled.waiting` are too recent to send again."""
    specs = {p.point_id: p.spec for p in all_points if p.spec}
    settled = backend.settle([RunDir(spec.run_dir) for spec in specs.values()])
    for pid, spec in specs.items():
        entry = ledger.points.get(pid, {})
        job = settled.found.get(Path(spec.run_dir))
        if job is None and entry.get("state") == "submitting":
            # the array's own record (hpcrun stopped after it), or a job the run got since (hpcrun resume)
            latest = RunDir(spec.run_dir).latest_job()
            if latest and (latest.get("tag") == entry.get("tag") or str(latest["job_id"]) != str(entry.get("job_id"))):
                job = str(latest["job_id"])
        if job is not None:
            if entry.get("state") == "submitting":
                outcome.found.append((str(entry.get("label", pid)), job))
            ledger.record(pid, job_id=job, state="submitted")
    return settled


def schedule(site: Site, recipe_file: RecipeFile, dry_run: bool = False, retry_failed: bool = False) -> Outcome:
    """Submit the points of a sweep that are missing (and, if asked, those that failed)."""
    sid = sweep_id(recipe_file, site)
    root = sweep_dir(site.storage.runs_dir, sid)
    outcome = Outcome(sid, root)
    all_points = points(site, recipe_file, sid)
    limit = recipe_file.sweep.max_concurrent if recipe_file.sweep else None
    with Ledger.locked(root) as ledger:
        check_run_dirs(all_points)
        # before --retry-failed reads the points' latest jobs: a lost answer's job is the latest
        settled = backend.Settled() if dry_run else reconcile(ledger, all_points, outcome)
        retry: set[str] = set()
        if retry_failed:
            dirs = {
                p.point_id: Path(p.spec.run_dir)
                for p in all_points
                if p.spec and ledger.points.get(p.point_id, {}).get("job_id")
            }
            failed = {s.run_id for s in statuses(list(dirs.values())) if jobstate.failed(s.state)}
            retry = {pid for pid, d in dirs.items() if d.name in failed}
        todo = []
        for p in all_points:
            if p.skipped:
                outcome.skipped.append((p.label, p.skipped))
                ledger.record(p.point_id, label=p.label, state="skipped", reason=p.skipped)
            elif p.spec and Path(p.spec.run_dir) in settled.waiting:
                outcome.waiting.append(p.label)
            elif ledger.points.get(p.point_id, {}).get("state") == "submitting":
                todo.append(p)  # sent before, and SLURM has no job for it: send again
            elif ledger.points.get(p.point_id, {}).get("job_id") and p.point_id not in retry:
                outcome.already += 1
            else:
                todo.append(p)
        specs = [p.spec for p in todo if p.spec]
        by_run = {p.spec.run_id: p for p in todo if p.spec}
        if site.scheduler == "local":  # one machine: points run one after another
            for spec in specs:
                point = by_run[spec.run_id]
                outcome.arrays.append(("local", [point.label]))
                if dry_run:
                    outcome.scripts.append(render.render(spec))
                    continue
                backend.prepare(spec)
                job = backend.submit(spec)
                outcome.submitted.append((point.label, job))
                ledger.record(point.point_id, label=point.label, run_id=spec.run_id, job_id=job, state="submitted")
                ledger.save()
                wait([Path(spec.run_dir)])
        else:
            size, cap = quota.MAX_ARRAY_SIZE, None
            if specs and not dry_run:
                size, cap = quota.limits(site.account, site.qos, sorted({s.partition for s in specs}))
            chunks, deferred = arrays(specs, size, cap.headroom if cap else None)
            outcome.deferred = [by_run[s.run_id].label for s in deferred]
            outcome.cap = cap.describe() if cap else None
            for chunk in chunks:
                spec_text = f"0-{len(chunk) - 1}" + (f"%{limit}" if limit else "")
                outcome.arrays.append((spec_text, [by_run[s.run_id].label for s in chunk]))
                tag = backend.array_tag(chunk)
                if dry_run:
                    outcome.scripts.append(render.render_array(chunk, spec_text, root / LOGS, tag))
                    continue
                now = time.time()
                for spec in chunk:  # the intent, saved before sbatch is called (hpcrun.backend.settle)
                    point = by_run[spec.run_id]
                    intent = {"state": "submitting", "tag": tag, "at": now}
                    ledger.record(point.point_id, label=point.label, run_id=spec.run_id, **intent)
                ledger.save()
                jobs = backend.submit_array(chunk, root / LOGS, limit, tag)
                for spec, job in zip(chunk, jobs):
                    point = by_run[spec.run_id]
                    outcome.submitted.append((point.label, job))
                    ledger.record(point.point_id, label=point.label, run_id=spec.run_id, job_id=job, state="submitted")
                ledger.save()  # after each array: a later failure keeps what went out
        if not dry_run:
            ledger.save()
    return outcome
