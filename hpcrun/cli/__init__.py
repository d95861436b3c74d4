"""The `hpcrun` command: parse, call, print. One module per verb group; the logic lives in the
modules named after nouns (hpcrun.plan, hpcrun.campaign, hpcrun.status, ...).

    recipes     render, validate, plan        what a recipe would do, before anything is sent
    sites       sites [show], doctor          what a site is, and whether it is what it says
    submission  submit, sweep, resume         sending work
    runs        status, logs, cancel, checkpoint   following and handling what was sent
    results     results [compact|check], report    what the runs measured
"""

from __future__ import annotations

import sys
import typing as tp

import click

from hpcrun import __version__
from hpcrun.cli import recipes, results, runs, sites, submission
from hpcrun.errors import HpcrunError


class Group(click.Group):
    """Bad input is one line and exit code 2; `--debug` shows the traceback instead."""

    def invoke(self, ctx: click.Context) -> tp.Any:
        try:
            return super().invoke(ctx)
        except HpcrunError:
            if ctx.meta.get("hpcrun.debug"):
                raise RuntimeError("--debug: traceback of the error above") from sys.exc_info()[1]
            raise


@click.group(cls=Group)
@click.version_option(__version__, prog_name="hpcrun")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Render, submit and requeue multi-node PyTorch training on SLURM, and compare the runs."""
    ctx.meta["hpcrun.debug"] = debug


for module in (recipes, sites, submission, runs, results):
    for command in module.COMMANDS:
        main.add_command(command)
