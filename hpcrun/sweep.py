"""Sweep expansion: the matrix of a recipe's `sweep.axes`, less `exclude`, plus `include`."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import typing as tp
from pathlib import Path

from hpcrun.recipe import Sweep

if tp.TYPE_CHECKING:
    from hpcrun.plan import RunSpec
    from hpcrun.recipe import RecipeFile
    from hpcrun.site import Site


def _matches(point: dict[str, tp.Any], pattern: dict[str, tp.Any]) -> bool:
    return all(key in point and _same(point[key], value) for key, value in pattern.items())


def _same(a: tp.Any, b: tp.Any) -> bool:
    # `strategy: ddp` and `strategy: {name: ddp}` name the same axis value
    norm = lambda v: {"name": v} if isinstance(v, str) else v  # noqa: E731
    return a == b or norm(a) == norm(b)


def expand(sweep: Sweep) -> list[dict[str, tp.Any]]:
    """Every point as `{dotted field: value}`, in axis order, without duplicates."""
    keys = list(sweep.axes)
    points = [dict(zip(keys, values)) for values in itertools.product(*(sweep.axes[k] for k in keys))]
    points = [p for p in points if not any(_matches(p, ex) for ex in sweep.exclude)]
    for extra in sweep.include:
        if not any(_matches(p, extra) and _matches(extra, p) for p in points):
            points.append(dict(extra))
    return points


def point_id(point: dict[str, tp.Any]) -> str:
    """A short stable id for a point, the same in every invocation (the ledger's key)."""
    blob = json.dumps(point, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def describe(point: dict[str, tp.Any]) -> str:
    parts = []
    for key, value in point.items():
        if isinstance(value, dict):
            value = ",".join(f"{k}={v}" for k, v in value.items())
        parts.append(f"{key}={value}")
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Point:
    point_id: str
    overrides: dict[str, tp.Any]
    spec: "RunSpec | None"
    skipped: str | None = None

    @property
    def label(self) -> str:
        return describe(self.overrides)


def sweep_id(recipe_file: "RecipeFile", site: "Site") -> str:
    """The same recipe on the same site is the same sweep: re-running it continues it."""
    blob = json.dumps({"recipe": recipe_file.raw, "sweep": recipe_file.sweep.model_dump() if recipe_file.sweep else None, "site": site.name}, sort_keys=True, default=str)
    return f"{recipe_file.base.name}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def points(site: "Site", recipe_file: "RecipeFile", sid: str) -> list[Point]:
    """Every point, planned on `site`; one that cannot run there is kept with the reason."""
    from hpcrun.errors import HpcrunError
    from hpcrun.memory import misfit
    from hpcrun.plan import plan_point

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


def shape(spec: "RunSpec") -> tuple[tp.Any, ...]:
    """Points with the same shape share one sbatch script, so they can go out as one array."""
    r = spec.recipe
    return (spec.partition, spec.nodes, spec.ranks_per_node, spec.time_min, spec.signal_lead_s, spec.nvme_dir, r.resources.cpus_per_task, tuple(sorted(spec.env.items())))


def arrays(specs: list["RunSpec"], max_array_size: int, headroom: int | None) -> tuple[list[list["RunSpec"]], list["RunSpec"]]:
    """(chunks to submit as arrays, points deferred for lack of MaxSubmitJobs headroom): points
    grouped by shape, each group split to stay under MaxArraySize."""
    groups: dict[tuple[tp.Any, ...], list[RunSpec]] = {}
    for spec in specs:
        groups.setdefault(shape(spec), []).append(spec)
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
    already: int = 0
    scripts: list[str] = dataclasses.field(default_factory=list)


def schedule(site: "Site", recipe_file: "RecipeFile", dry_run: bool = False, retry_failed: bool = False) -> Outcome:
    """Submit the points of a sweep that are missing (and, if asked, those that failed), as job
    arrays of same-shape points. Holding the ledger's lock from reading to recording makes
    concurrent invocations submit each point once."""
    from hpcrun import backend
    from hpcrun.ledger import Ledger
    from hpcrun.render import render
    from hpcrun.status import statuses, wait

    sid = sweep_id(recipe_file, site)
    root = Path(site.storage.runs_dir) / "sweeps" / sid
    outcome = Outcome(sid, root)
    all_points = points(site, recipe_file, sid)
    limit = recipe_file.sweep.max_concurrent if recipe_file.sweep else None
    with Ledger.locked(root) as ledger:
        retry: set[str] = set()
        if retry_failed:
            dirs = {p.point_id: Path(p.spec.run_dir) for p in all_points if p.spec and ledger.points.get(p.point_id, {}).get("job_id")}
            failed = {s.run_id for s in statuses(list(dirs.values())) if s.state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")}
            retry = {pid for pid, d in dirs.items() if d.name in failed}
        todo = []
        for p in all_points:
            if p.skipped:
                outcome.skipped.append((p.label, p.skipped))
                ledger.record(p.point_id, label=p.label, state="skipped", reason=p.skipped)
            elif ledger.points.get(p.point_id, {}).get("job_id") and p.point_id not in retry:
                outcome.already += 1
            else:
                todo.append(p)
        specs = [p.spec for p in todo if p.spec]
        by_run = {p.spec.run_id: p for p in todo if p.spec}
        if site.scheduler == "local":  # one machine: points run one after another
            for spec in specs:
                outcome.arrays.append(("local", [by_run[spec.run_id].label]))
                if dry_run:
                    outcome.scripts.append(render(spec))
                    continue
                backend.prepare(spec)
                job = backend.submit(spec)
                outcome.submitted.append((by_run[spec.run_id].label, job))
                ledger.record(by_run[spec.run_id].point_id, label=by_run[spec.run_id].label, run_id=spec.run_id, job_id=job, state="submitted")
                ledger.save()
                wait([Path(spec.run_dir)])
        else:
            chunks, deferred = arrays(specs, *(limits() if not dry_run else (1001, None)))
            outcome.deferred = [by_run[s.run_id].label for s in deferred]
            for chunk in chunks:
                spec_text = f"0-{len(chunk) - 1}" + (f"%{limit}" if limit else "")
                outcome.arrays.append((spec_text, [by_run[s.run_id].label for s in chunk]))
                if dry_run:
                    outcome.scripts.append(render(chunk[0], array=spec_text, log_folder=root / "logs"))
                    continue
                jobs = backend.submit_array(chunk, root / "logs", limit)
                for spec, job in zip(chunk, jobs):
                    point = by_run[spec.run_id]
                    outcome.submitted.append((point.label, job))
                    ledger.record(point.point_id, label=point.label, run_id=spec.run_id, job_id=job, state="submitted")
                ledger.save()  # after each array: a later failure keeps what went out
        if not dry_run:
            ledger.save()
    return outcome


def limits() -> tuple[int, int | None]:
    """(MaxArraySize, jobs the user may still submit under MaxSubmitJobs, or None if unlimited)."""
    import getpass
    import subprocess

    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    size = next((int(l.split("=")[1]) for l in config.splitlines() if l.split("=")[0].strip() == "MaxArraySize"), 1001)
    user = getpass.getuser()
    assoc = subprocess.run(["sacctmgr", "-n", "-P", "show", "assoc", f"where user={user}", "format=MaxSubmit"], capture_output=True, text=True).stdout
    caps = [int(x) for x in assoc.split() if x.strip().isdigit()]
    if not caps:
        return size, None
    queued = subprocess.run(["squeue", "-h", "-r", "-u", user, "-o", "%i"], capture_output=True, text=True).stdout.split()
    return size, max(0, min(caps) - len(queued))
