"""`hpcrun sites [show]` and `hpcrun doctor`: what a site profile says, and whether the cluster
agrees."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpcrun.cli.options import site_option
from hpcrun.errors import HpcrunError


@click.group(invoke_without_command=True)
@click.pass_context
def sites(ctx: click.Context) -> None:
    """List the site profiles on the search path."""
    if ctx.invoked_subcommand is not None:
        return
    from hpcrun.site import known_sites, load_site

    for name, path in known_sites().items():
        try:
            site = load_site(str(path))
            parts = ", ".join(
                f"{p} ({v.max_nodes}x{v.gpus_per_node or v.cpus_per_node} {v.gpu.model if v.gpu else 'CPU'})"
                for p, v in site.partitions.items()
            )
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


@click.command()
@site_option
@click.option("--nodes", default=1, show_default=True, help="Nodes for the probe job.")
@click.option("--login-only", is_flag=True, help="Only the login-node checks (about a second).")
def doctor(site_name: str, nodes: int, login_only: bool) -> None:
    """Check a site for real: scheduler view, account, test submission, then a probe job that
    reports each rank's environment and the all-reduce bus bandwidth. Exit 1 on a failure."""
    from hpcrun import backend
    from hpcrun.doctor import login_checks, probe_findings, record
    from hpcrun.plan import new_run_id, plan
    from hpcrun.recipe import Recipe
    from hpcrun.render import render as render_script
    from hpcrun.site import load_site
    from hpcrun.status import wait

    site = load_site(site_name)
    part = site.partitions[site.default_partition]
    ranks = min(part.max_ranks_per_node, 2) if not part.gpus_per_node else part.gpus_per_node
    probe = Recipe.model_validate(
        {
            "name": "doctor",
            "resources": {"nodes": nodes, "gpus_per_node": ranks, "time": min(10, part.max_time)},
            "job": {
                "kind": "command",
                "command": [*(site.environment.python or [sys.executable]), "-m", "hpcrun.runtime.probe"],
            },
            "checkpoint": {"max_requeues": 0},  # a probe that fails has found something: never retry it
        }
    )
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


COMMANDS = [sites, doctor]
