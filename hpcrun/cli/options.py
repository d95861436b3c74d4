"""Options and arguments several verbs share: `--site`, the results filters, and RUN (a path, a
run id, a sweep id or a unique prefix of a run id)."""

from __future__ import annotations

import os
import typing as tp
from pathlib import Path

import click

from hpcrun.errors import HpcrunError
from hpcrun.rundir import SPEC, RunDir

site_option = click.option(
    "--site", "site_name", default="local", show_default=True, help="Site name on the search path, or a YAML file."
)

results_options = [
    site_option,
    click.option(
        "--dir",
        "results_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="A results directory (default: the site's).",
    ),
    click.option("--sweep", default=None, help="Only this sweep id."),
    click.option("--strategy", default=None, help="Only this strategy."),
    click.option("--since", default=None, help="Only runs started at or after this date/time (UTC)."),
]

SHOWN_CANDIDATES = 8


def with_options(options: list[tp.Callable[..., tp.Any]]) -> tp.Callable[..., tp.Any]:
    def apply(fn: tp.Callable[..., tp.Any]) -> tp.Callable[..., tp.Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


def run_dirs(site_name: str, target: str | None, many: bool = False) -> list[Path]:
    """The runs RUN names: a run directory's path, or under the site's runs directory a run id
    (an exact match wins), a sweep id or a staged submission's id (`many`: all of its runs), or
    a prefix that matches one run. A prefix that matches several is refused with the candidates:
    taking the first would act on a run the user did not mean. No RUN: every run (`many`)."""
    from hpcrun.site import load_site

    if target and (os.sep in target or RunDir(target).is_run()):
        if not RunDir(target).is_run():
            raise HpcrunError(f"not a run directory (no {SPEC})", target)
        return [Path(target)]
    root = Path(load_site(site_name).storage.runs_dir)
    runs = sorted(p for p in root.iterdir() if RunDir(p).is_run()) if root.is_dir() else []
    if not target:
        if not many:
            raise HpcrunError("name a run", field="RUN")
        return runs
    exact = [p for p in runs if p.name == target]
    if exact:
        return exact
    group = [p for p in runs if p.name.startswith(f"{target}.")]  # `<sweep id>.<point>`, `<run id>.<stage>`
    if group and many:
        return group
    matches = [p for p in runs if p.name.startswith(target)]
    if not matches:
        raise HpcrunError(f"no run {target!r} under {root}", field="RUN")
    if len(matches) > 1:
        names = ", ".join(p.name for p in matches[:SHOWN_CANDIDATES]) + (
            f" and {len(matches) - SHOWN_CANDIDATES} more" if len(matches) > SHOWN_CANDIDATES else ""
        )
        raise HpcrunError(f"{target!r} matches {len(matches)} runs ({names}); give one run id", field="RUN")
    return matches


def one_run(site_name: str, target: str) -> Path:
    (run_dir,) = run_dirs(site_name, target)
    return run_dir
