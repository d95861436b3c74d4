"""`hpcrun render`, `hpcrun validate`, `hpcrun plan`: what a recipe would do on a site, before
anything is sent."""

from __future__ import annotations

import typing as tp
from pathlib import Path

import click

from hpcrun.cli.options import site_option
from hpcrun.errors import HpcrunError

if tp.TYPE_CHECKING:
    from hpcrun.plan import RunSpec
    from hpcrun.strategies import Option


@click.command()
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


@click.command()
@click.option("--site", "site_name", default=None, help="Also check recipes against this site.")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
def validate(site_name: str | None, files: tuple[Path, ...]) -> None:
    """Check site profiles and recipes; one line per file, exit code 2 if any is wrong."""
    from hpcrun.site import load_site
    from hpcrun.validation import check_file

    site = load_site(site_name) if site_name else None
    failed = 0
    for file in files:
        try:
            click.echo(f"ok    {file}: {check_file(file, site)}")
        except HpcrunError as exc:
            failed += 1
            click.echo(f"error {exc.message}", err=True)
    if failed:
        raise SystemExit(2)


@click.command("plan")
@site_option
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
def plan_command(site_name: str, recipe: Path) -> None:
    """Memory per GPU, host and NVMe for each strategy on the site; which fit, and which to use."""
    from tabulate import tabulate

    from hpcrun.measured import measured_peaks
    from hpcrun.memory import GB, Estimate, estimate, largest_micro_batch, recommend
    from hpcrun.mtbf import resolve
    from hpcrun.plan import plan
    from hpcrun.recipe import load_recipe
    from hpcrun.site import load_site

    site = load_site(site_name)
    recipe_file = load_recipe(recipe)
    if recipe_file.base.job.kind != "benchmark":
        raise HpcrunError(
            "the planner knows the built-in benchmark's model only (job.kind: benchmark)", recipe, "job.kind"
        )
    spec = resolve(plan(site, recipe_file.base, recipe, "plan"))  # the MTBF a submission now would learn
    mb = spec.recipe.training.micro_batch
    rows = estimate(spec)
    spares = f"; +{spec.spare_nodes} spare node(s), held idle for the job" if spec.spare_nodes else ""
    click.echo(
        f"{recipe_file.base.job.model} on {spec.nodes} x {spec.ranks_per_node} of {site.name}/{spec.partition} "
        f"({spec.recipe.precision}{spares}):"
    )
    peaks = measured_peaks(spec)

    def measured(e: Estimate) -> list[str]:
        peak = peaks.get(e.option.name)
        return ["", ""] if peak is None else [f"{peak / GB:.1f}", f"{e.gpu_gb * GB / peak - 1:+.0%}"]

    table = [
        [
            e.option.name,
            f"{e.gpu_gb:.1f}",
            *(measured(e) if peaks else []),
            "" if e.deepspeed_gpu_gb is None else f"{e.deepspeed_gpu_gb:.1f}",
            f"{e.cpu_gb_per_node:.0f}",
            f"{e.snapshot_gb_per_node:.2g}",
            f"{e.nvme_gb_per_node:.0f}",
            "yes" if e.fits else "no",
            "" if e.fits else e.why,
        ]
        for e in rows
    ]
    headers = ["strategy", "GPU GB", *(["measured GB", "planned vs measured"] if peaks else [])]
    headers += ["DeepSpeed est. states GB"]
    headers += ["host GB/node", "snapshots GB/node", "NVMe GB/node", "fits", "why not"]
    click.echo(tabulate(table, headers=headers, tablefmt="simple"))
    best, why = recommend(rows)
    click.echo(f"recommended: {why}" if best else why)
    if best:
        largest = largest_micro_batch(spec, best.option, limit=4096)
        shown = f"{largest} or more" if largest == 4096 else str(largest)  # the search stops there
        click.echo(f"largest micro-batch that fits with {best.option.name}: {shown} (the recipe's: {mb})")
    if peaks:
        click.echo(f"measured: the largest peak_memory_bytes of this site's runs of this shape ({spec.results_dir})")
    click.echo(spec.mtbf_said())
    for line in saves(spec, [e.option for e in rows]):
        click.echo(line)


def saves(spec: RunSpec, options: list[Option]) -> list[str]:
    """How the run will space its checkpoints and snapshots, from a cost estimated by the size of
    a rank's state (the job decides again from what it measures: `hpcrun status RUN`)."""
    from hpcrun.cadence import estimated_cost_s
    from hpcrun.memory import staging_bytes

    assert spec.size is not None, "the planner knows the built-in model only"
    fields = spec.strategy.model_dump()
    own = next((o for o in options if all(fields.get(k) == v for k, v in o.recipe.items())), None)
    params = spec.size.parameters(spec.recipe.training.seq_len) + spec.size.ballast_mb * 2**20 / 12
    state = staging_bytes(params, spec.world_size, own, 1) if own and own.stages_checkpoints else 12 * params
    kinds: list[tp.Literal["checkpoint", "snapshot"]] = ["checkpoint", "snapshot"] if spec.takes_snapshots else [
        "checkpoint"]
    cost = estimated_cost_s(state, accelerator=spec.gpus_per_node > 0)
    return [spec.cadence(kind).explain(cost, measured=False) for kind in kinds]


COMMANDS = [render, validate, plan_command]
