"""`hpcrun validate`: tell a site file from a recipe and check it (against a site, if given)."""

from __future__ import annotations

from pathlib import Path

from hpcrun.loader import read_yaml
from hpcrun.plan import runs_of
from hpcrun.recipe import load_recipe
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
    return f"{what}: {len(runs)} run(s) fit site {site.name}"
