"""The `hpcrun` command: parse, call, print. Logic lives in the modules named after nouns."""

from __future__ import annotations

import sys
import typing as tp
from pathlib import Path

import click

from hpcrun import __version__
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


site_option = click.option("--site", "site_name", default="local", show_default=True, help="Site name on the search path, or a YAML file.")


@main.command()
@site_option
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--run-id", default=None, help="Render for this run id (submit prints the one it used).")
@click.option("--index", default=0, show_default=True, help="Which stage or sweep point to print.")
def render(site_name: str, recipe: Path, run_id: str | None, index: int) -> None:
    """Print the script that `submit` would send for RECIPE on a site."""
    from hpcrun.plan import new_run_id, runs_of
    from hpcrun.recipe import load_recipe
    from hpcrun.render import render as render_script
    from hpcrun.site import load_site

    site = load_site(site_name)
    recipe_file = load_recipe(recipe)
    specs = runs_of(site, recipe_file, run_id or new_run_id(recipe_file.base.name))
    if not 0 <= index < len(specs):
        raise HpcrunError(f"must be between 0 and {len(specs) - 1} for this recipe (got {index})", field="--index")
    if len(specs) > 1:
        click.echo(f"# {len(specs)} runs in this recipe; showing --index {index} ({specs[index].run_id})", err=True)
    click.echo(render_script(specs[index]), nl=False)


@main.group(invoke_without_command=True)
@click.pass_context
def sites(ctx: click.Context) -> None:
    """List the site profiles on the search path."""
    if ctx.invoked_subcommand is not None:
        return
    from hpcrun.site import known_sites, load_site

    for name, path in known_sites().items():
        try:
            site = load_site(str(path))
            parts = ", ".join(f"{p} ({v.max_nodes}x{v.gpus_per_node or v.cpus_per_node} {v.gpu.model if v.gpu else 'CPU'})" for p, v in site.partitions.items())
            click.echo(f"{name:14} {site.scheduler:6} {site.network.interconnect:10} {parts}  [{path}]")
        except HpcrunError as exc:
            click.echo(f"{name:14} INVALID  {exc.message}")


@sites.command("show")
@click.argument("name")
def sites_show(name: str) -> None:
    """Print one site resolved: defaults filled in, paths expanded, interconnect environment."""
    import yaml

    from hpcrun.site import load_site

    site = load_site(name)
    data = site.model_dump(mode="json")
    data["resolved_environment"] = site.interconnect_env()
    click.echo(f"# {site.source}")
    click.echo(yaml.safe_dump(data, sort_keys=False), nl=False)


@main.command()
@click.option("--site", "site_name", default=None, help="Also check recipes against this site.")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
def validate(site_name: str | None, files: tuple[Path, ...]) -> None:
    """Check site profiles and recipes; one line per file, exit code 2 if any is wrong."""
    from hpcrun.validation import check_file

    site = None
    if site_name:
        from hpcrun.site import load_site

        site = load_site(site_name)
    failed = 0
    for file in files:
        try:
            click.echo(f"ok    {file}: {check_file(file, site)}")
        except HpcrunError as exc:
            failed += 1
            click.echo(f"error {exc.message}", err=True)
    if failed:
        raise SystemExit(2)


if __name__ == "__main__":
    main()
