"""Options and arguments several verbs share: `--site`, the results filters, and RUN (a path, a
run id, a sweep id or a unique prefix of a run id)."""

from __future__ import annotations

import typing as tp
from pathlib import Path

import click

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


def with_options(options: list[tp.Callable[..., tp.Any]]) -> tp.Callable[..., tp.Any]:
    def apply(fn: tp.Callable[..., tp.Any]) -> tp.Callable[..., tp.Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


def run_dirs(site_name: str, target: str | None, many: bool = False) -> list[Path]:
    """The runs RUN names (hpcrun.api.runs): a path, a run id, a sweep or staged submission's id
    (`many`: all of its runs), or a prefix matching one run; no RUN: every run (`many`)."""
    from hpcrun.api import runs

    return [run.path for run in runs(site_name, target, many)]


def one_run(site_name: str, target: str) -> Path:
    (run_dir,) = run_dirs(site_name, target)
    return run_dir
