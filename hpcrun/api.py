"""hpcrun from Python: submit a recipe to a site, follow its runs, read what they measured, cancel
them. These are the functions `hpcrun submit`, `status`, `results` and `cancel` call, returning
values instead of printing lines; errors are `hpcrun.errors.HpcrunError` (one line naming the file
and field, as on the command line). Nothing here imports torch: it runs on a login node.

    from hpcrun import api

    [run] = api.submit({"name": "try", "training": {"steps": 20}}, site="local")
    run.wait(timeout=600).state                     # 'COMPLETED'
    run.results()[["strategy", "tokens_per_s", "final_loss"]]
    run.steps().plot(x="step", y="loss")
"""

from __future__ import annotations

import dataclasses
import os
import typing as tp
from pathlib import Path

from hpcrun.errors import HpcrunError
from hpcrun.rundir import SPEC, RunDir

if tp.TYPE_CHECKING:
    import pandas as pd

    from hpcrun.plan import RunSpec
    from hpcrun.recipe import RecipeFile
    from hpcrun.status import RunStatus

SHOWN_CANDIDATES = 8  # runs an ambiguous prefix names in its refusal
RecipeSource: tp.TypeAlias = "str | Path | dict[str, tp.Any]"


@dataclasses.dataclass(frozen=True)
class Run:
    """One run: its directory under the site's runs directory, and what its jobs did."""

    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def job_id(self) -> str | None:
        """The run's latest job (None for a dry run)."""
        job = RunDir(self.path).latest_job()
        return None if job is None else str(job["job_id"])

    def spec(self) -> RunSpec:
        """The resolved plan the run was submitted with (runspec.json)."""
        from hpcrun.backend import load_spec

        return load_spec(self.path)

    def status(self) -> RunStatus:
        """Where the run's latest job stands (state, nodes, restarts, and rank 0's progress: step
        of total, tokens/s, ETA), asked of the scheduler now."""
        from hpcrun.status import statuses

        found = statuses([self.path], max_age=0)
        if not found:
            raise HpcrunError("no job was submitted for this run (a dry run?)", self.path)
        return found[0]

    def wait(self, timeout: float | None = None) -> RunStatus:
        """Follow the run until its latest job has ended, or `timeout` seconds; returns the last
        status (`.done` says which). The scheduler is asked as `hpcrun status --wait` asks it."""
        from hpcrun.status import wait

        if self.job_id is None:
            raise HpcrunError("no job was submitted for this run (a dry run?)", self.path)
        return wait([self.path], timeout=timeout)[0]

    def cancel(self) -> str:
        """Cancel the run's latest job; returns its id. A job that has ended is refused (HpcrunError)."""
        from hpcrun.cancel import cancel

        return cancel(self.path)

    def results(self) -> pd.DataFrame:
        """The run's attempts' rows from the site's results table (hpcrun.results.load)."""
        from hpcrun.results import load

        return load(str(self.spec().site.results_dir), run_id=self.run_id)

    def steps(self) -> pd.DataFrame:
        """The run's per-step rows, one per step across requeues (hpcrun.steps.load_steps)."""
        from hpcrun.steps import load_steps

        return load_steps(str(self.spec().site.results_dir), run_id=self.run_id)

    def log(self, rank: int = 0, stream: str = "out") -> str:
        """A rank's log of the latest job, as written so far."""
        from hpcrun.logs import log_path

        path = log_path(self.path, rank, stream)
        return path.read_text(errors="replace") if path.exists() else ""


def load(recipe: RecipeSource) -> RecipeFile:
    """A recipe file's path, or its content as a dict (read as if it were a file in the current
    directory named after the recipe: errors name that file, relative paths start there)."""
    from hpcrun.recipe import load_recipe, parse_recipe

    if isinstance(recipe, dict):
        name = str(recipe.get("name") or "recipe")
        return parse_recipe(recipe, Path.cwd() / f"{name}.yaml")
    return load_recipe(recipe)


def submit(
    recipe: RecipeSource, site: str = "local", run_id: str | None = None, dry_run: bool = False,
    on_each: tp.Callable[[Run], None] | None = None,
) -> list[Run]:
    """Submit a recipe (stages in order, each depending on the one before); returns its runs, and
    hands each to `on_each` as it goes out. `dry_run` writes the run directories and scripts and
    submits nothing. A run whose latest job has not ended is refused before its files change."""
    from hpcrun import backend
    from hpcrun.plan import new_run_id, runs_of
    from hpcrun.site import load_site

    recipe_file = load(recipe)
    specs = runs_of(load_site(site), recipe_file, run_id or new_run_id(recipe_file.base.name))
    previous: str | None = None
    runs = []
    for spec in specs:
        run = Run(backend.prepare_run(spec))
        runs.append(run)
        if not dry_run:
            dependency = f"{_dependency(recipe_file, spec)}:{previous}" if previous and spec.stage else None
            previous = backend.submit(spec, dependency)
        if on_each is not None:
            on_each(run)
    return runs


def _dependency(recipe_file: RecipeFile, spec: RunSpec) -> str:
    return str(next(stage.dependency for stage, _ in recipe_file.stages if stage.name == spec.stage))


def resume(run: Run) -> str:
    """Submit a run again: it continues from its newest complete checkpoint. Returns the job id."""
    from hpcrun import backend

    spec = run.spec()
    backend.prepare_run(spec)
    return backend.submit(spec)


def runs(site: str = "local", target: str | None = None, many: bool = True) -> list[Run]:
    """The runs `target` names: a run directory's path, or under the site's runs directory a run
    id (an exact match wins), a sweep id or a staged submission's id (with `many`: all of its
    runs), or a prefix matching one run. A prefix matching several is refused with the candidates:
    taking the first would act on a run the caller did not mean. No target: every run (`many`)."""
    from hpcrun.site import load_site

    if target and (os.sep in target or RunDir(target).is_run()):
        if not RunDir(target).is_run():
            raise HpcrunError(f"not a run directory (no {SPEC})", target)
        return [Run(Path(target))]
    root = Path(load_site(site).storage.runs_dir)
    found = sorted(p for p in root.iterdir() if RunDir(p).is_run()) if root.is_dir() else []
    if not target:
        if not many:
            raise HpcrunError("name a run", field="RUN")
        return [Run(p) for p in found]
    exact = [p for p in found if p.name == target]
    if exact:
        return [Run(exact[0])]
    group = [p for p in found if p.name.startswith(f"{target}.")]  # `<sweep id>.<point>`, `<run id>.<stage>`
    if group and many:
        return [Run(p) for p in group]
    matches = [p for p in found if p.name.startswith(target)]
    if not matches:
        raise HpcrunError(f"no run {target!r} under {root}", field="RUN")
    if len(matches) > 1:
        names = ", ".join(p.name for p in matches[:SHOWN_CANDIDATES]) + (
            f" and {len(matches) - SHOWN_CANDIDATES} more" if len(matches) > SHOWN_CANDIDATES else ""
        )
        raise HpcrunError(f"{target!r} matches {len(matches)} runs ({names}); give one run id", field="RUN")
    return [Run(matches[0])]


def results(site: str = "local", **filters: tp.Any) -> pd.DataFrame:
    """Every attempt's row in the site's results table; `filters` are column=value (or list)."""
    from hpcrun.results import load
    from hpcrun.site import load_site

    return load(str(load_site(site).results_dir), **filters)


def steps(site: str = "local", **filters: tp.Any) -> pd.DataFrame:
    """The site's per-step table (run_id=, sweep_id=, strategy= or any column=value)."""
    from hpcrun.site import load_site
    from hpcrun.steps import load_steps

    return load_steps(str(load_site(site).results_dir), **filters)
