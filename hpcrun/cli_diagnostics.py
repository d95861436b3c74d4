"""`hpcrun doctor`, `hpcrun plan` and `hpcrun checkpoint`: checking a site and a recipe before and after."""

from __future__ import annotations

from pathlib import Path

import click

from hpcrun.cli import _run_dirs, main, site_option
from hpcrun.errors import HpcrunError


@main.command()
@site_option
@click.option("--nodes", default=1, show_default=True, help="Nodes for the probe job.")
@click.option("--login-only", is_flag=True, help="Only the login-node checks (about a second).")
def doctor(site_name: str, nodes: int, login_only: bool) -> None:
    """Check a site for real: scheduler view, account, test submission, then a probe job that
    reports each rank's environment and the all-reduce bus bandwidth. Exit 1 on a failure."""
    import sys as _sys

    from hpcrun import backend
    from hpcrun.doctor import login_checks, probe_findings, record
    from hpcrun.status import wait
    from hpcrun.plan import new_run_id, plan
    from hpcrun.recipe import Recipe
    from hpcrun.render import render as render_script
    from hpcrun.site import load_site

    site = load_site(site_name)
    part = site.partitions[site.default_partition]
    ranks = min(part.max_ranks_per_node, 2) if not part.gpus_per_node else part.gpus_per_node
    probe = Recipe.model_validate({
        "name": "doctor", "resources": {"nodes": nodes, "gpus_per_node": ranks, "time": min(10, part.max_time)},
        "job": {"kind": "command", "command": [*(site.environment.python or [_sys.executable]), "-m", "hpcrun.runtime.probe"]},
        "checkpoint": {"max_requeues": 0},  # a probe that fails has found something: never retry it
    })
    spec = plan(site, probe, site.source or site.name, new_run_id("doctor"))
    findings = login_checks(site, render_script(spec))
    for finding in findings:
        click.echo(finding.line())
    if not login_only and not any(f.status == "fail" for f in findings):
        backend.prepare(spec)
        job = backend.submit(spec)
        click.echo(f"....  probe job {job} on {nodes} node(s) x {ranks} rank(s): {spec.run_dir}")
        (ended,) = wait([Path(spec.run_dir)], timeout=600)
        more = probe_findings(site, Path(spec.run_dir), ended.state)
        record(site, Path(spec.run_dir), nodes)
        for finding in more:
            click.echo(finding.line())
        findings += more
    if any(f.status == "fail" for f in findings):
        raise SystemExit(1)


@main.command("plan")
@site_option
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
def plan_command(site_name: str, recipe: Path) -> None:
    """Memory per GPU, host and NVMe for each strategy on the site; which fit, and which to use."""
    from tabulate import tabulate

    from hpcrun.memory import estimate, recommend
    from hpcrun.plan import plan
    from hpcrun.recipe import load_recipe
    from hpcrun.site import load_site

    site = load_site(site_name)
    recipe_file = load_recipe(recipe)
    if recipe_file.base.job.kind != "benchmark":
        raise HpcrunError("the planner knows the built-in benchmark's model only (job.kind: benchmark)", recipe, "job.kind")
    spec = plan(site, recipe_file.base, recipe, "plan")
    rows = estimate(spec)
    click.echo(f"{recipe_file.base.job.model} on {spec.nodes} x {spec.ranks_per_node} of {site.name}/{spec.partition} ({spec.recipe.precision}):")  # type: ignore[union-attr]
    table = [
        [e.option.name, f"{e.gpu_gb:.1f}", "" if e.deepspeed_gpu_gb is None else f"{e.deepspeed_gpu_gb:.1f}", f"{e.cpu_gb_per_node:.0f}", f"{e.nvme_gb_per_node:.0f}", "yes" if e.fits else "no", "" if e.fits else e.why]
        for e in rows
    ]
    headers = ["strategy", "GPU GB", "DeepSpeed est. states GB", "host GB/node", "NVMe GB/node", "fits", "why not"]
    click.echo(tabulate(table, headers=headers, tablefmt="simple"))
    best, why = recommend(rows)
    click.echo(f"recommended: {why}" if best else why)


@main.group()
def checkpoint() -> None:
    """Work with a run's checkpoints."""


@checkpoint.command("consolidate")
@site_option
@click.argument("run")
@click.option("--step", type=int, default=None, help="Which complete checkpoint (default: the newest).")
def checkpoint_consolidate(site_name: str, run: str, step: int | None) -> None:
    """Write one fp32 state dict from RUN's sharded (DCP or ZeRO) checkpoint."""
    from hpcrun.runtime.checkpoint import consolidate  # torch: this command is for after the run

    (run_dir,) = _run_dirs(site_name, run)[:1]
    try:
        path, digest = consolidate(run_dir, step)
    except FileNotFoundError as exc:
        raise HpcrunError(str(exc)) from exc
    click.echo(f"{path}  sha256 of weights {digest}")
