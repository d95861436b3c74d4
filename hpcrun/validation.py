"""`hpcrun validate`: tell a site file from a recipe and check it (against a site, if given)."""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder
from pathlib import Path

from hpcrun.errors import HpcrunError
from hpcrun.loader import read_yaml
from hpcrun.plan import RunSpec, runs_of
from hpcrun.recipe import EntrypointJob, load_recipe
from hpcrun.site import Site, load_site

# keys only a site profile has: a file with any of them is a site, even one that forgot
# `scheduler:` (it is then told so, instead of being checked as a recipe)
SITE_KEYS = {"scheduler", "partitions", "default_partition", "network", "storage"}


def is_site_file(path: Path) -> bool:
    return bool(SITE_KEYS & set(read_yaml(path)))


def check_file(path: Path, site: Site | None) -> str:
    """A short summary of a valid file; raises HpcrunError naming file and field otherwise."""
    if is_site_file(path):
        loaded = load_site(str(path))
        return f"site {loaded.name} ({loaded.scheduler}, {len(loaded.partitions)} partitions)"
    recipe_file = load_recipe(path)
    what = f"recipe {recipe_file.base.name}"
    if recipe_file.stages:
        what += f", {len(recipe_file.stages)} stages"
    if site is None:
        if recipe_file.sweep:
            from hpcrun.sweep import expand

            for point in expand(recipe_file.sweep):
                recipe_file.point(point)
            what += f", {len(expand(recipe_file.sweep))} sweep points"
        return what
    runs = runs_of(site, recipe_file, "validate")
    for spec in runs:
        check_entrypoint(path, spec)
    return f"{what}: {len(runs)} run(s) fit site {site.name}"


def check_entrypoint(path: Path, spec: RunSpec) -> None:
    """An entrypoint's module must be found where the job will look for it, when this machine
    can tell: the job runs this interpreter, and no container, module or setup line of the site
    changes its path. The module is looked up, not imported (it may need torch or a GPU)."""
    job, environment = spec.recipe.job, spec.site.environment
    if not isinstance(job, EntrypointJob) or environment.python or environment.container:
        return
    if environment.modules or environment.setup:
        return
    base = path.resolve().parent
    # the job's path: the recipe's pythonpath, the directory it was submitted from (python -m), then the interpreter's
    search = [str((base / entry).resolve()) for entry in job.pythonpath] + [os.getcwd(), *sys.path[1:]]
    module = job.entrypoint.split(":")[0]
    if not module_exists(module, search):
        where = ", ".join(job.pythonpath) or "no job.pythonpath"
        raise HpcrunError(
            f"module {module!r} not found (looked in {where}, the current directory and this Python's path)",
            path,
            "job.entrypoint",
        )


def module_exists(name: str, search: list[str]) -> bool:
    """Whether `name` (dotted) can be imported from `search`, found without running any of it."""
    if name.split(".")[0] in sys.builtin_module_names:
        return True
    locations: list[str] | None = search
    for part in name.split("."):
        found = PathFinder.find_spec(part, locations) if locations is not None else None
        if found is None:
            return False
        locations = list(found.submodule_search_locations) if found.submodule_search_locations is not None else None
    return True
