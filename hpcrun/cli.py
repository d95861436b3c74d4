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


def _run_dirs(site_name: str, target: str | None) -> list[Path]:
    """RUN as a path, or an id (or id prefix, e.g. a sweep id) under the site's runs directory."""
    from hpcrun.site import load_site

    if target and Path(target).is_dir():
        return [Path(target)]
    root = Path(load_site(site_name).storage.runs_dir)
    runs = sorted(p for p in root.glob("*") if (p / "runspec.json").exists()) if root.is_dir() else []
    if target:
        runs = [p for p in runs if p.name == target or p.name.startswith(target)]
        if not runs:
            raise HpcrunError(f"no run {target!r} under {root}", field="RUN")
    return runs


@main.command()
@site_option
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Write the run directory and script; do not call sbatch.")
@click.option("--wait", is_flag=True, help="Follow the job to its end; exit non-zero if it failed.")
@click.option("--run-id", default=None, help="Use this run id (re-using an unfinished run's id continues it).")
def submit(site_name: str, recipe: Path, dry_run: bool, wait: bool, run_id: str | None) -> None:
    """Submit RECIPE to a site (stages in order, with dependencies)."""
    from hpcrun import backend
    from hpcrun.plan import new_run_id, runs_of
    from hpcrun.recipe import load_recipe
    from hpcrun.site import load_site

    site = load_site(site_name)
    recipe_file = load_recipe(recipe)
    specs = runs_of(site, recipe_file, run_id or new_run_id(recipe_file.base.name))
    previous: str | None = None
    submitted = []
    for spec in specs:
        run_dir = backend.prepare(spec)
        if dry_run:
            click.echo(f"dry run: {run_dir / backend.SCRIPT_FILE}")
            continue
        dependency = f"{_dependency(recipe_file, spec)}:{previous}" if previous and spec.stage else None  # stages run in order
        job_id = backend.submit(spec, dependency)
        previous = job_id
        submitted.append(run_dir)
        click.echo(f"submitted {spec.run_id} as job {job_id} ({site.name})\n  run dir: {run_dir}")
    if submitted and not dry_run:
        click.echo(f"  follow:  hpcrun status --site {site.name} {submitted[-1].name}; hpcrun logs --site {site.name} {submitted[-1].name} --follow")
    if wait and submitted:
        _wait(submitted)


def _dependency(recipe_file: tp.Any, spec: tp.Any) -> str:
    return next(stage.dependency for stage, _ in recipe_file.stages if stage.name == spec.stage)


def _wait(run_dirs: list[Path]) -> None:
    from hpcrun.status import RunStatus, wait

    def show(current: list[RunStatus]) -> None:
        line = "  ".join(f"{s.run_id}: {s.state}" + (f" (restarts {s.restarts})" if s.restarts else "") for s in current)
        click.echo(line, err=True)

    try:
        current = wait(run_dirs, on_change=show)
    except KeyboardInterrupt:
        click.echo(f"\nleft the job running; reattach with: hpcrun status {run_dirs[-1]}", err=True)
        raise SystemExit(130)
    _print_results(run_dirs)
    if any(s.state != "COMPLETED" for s in current):
        raise SystemExit(1)


def _print_results(run_dirs: list[Path]) -> None:
    import pandas as pd

    from hpcrun.backend import load_spec
    from hpcrun.results import load

    for run_dir in run_dirs:
        spec = load_spec(run_dir)
        df = load(spec.site.results_dir, run_id=spec.run_id)
        if not len(df):
            continue
        last = df.sort_values("end_time").iloc[-1]
        if last["status"] != "completed":
            click.echo(f"{spec.run_id}: {last['status']}: {last['reason']}")
            continue
        shown = [
            ("world {}", last["world_size"]),
            ("final loss {:.4f}", last["final_loss"]),
            ("{:.0f} tokens/s", last["tokens_per_s"]),
            ("step p50 {:.1f} ms", last["step_time_p50_s"] * 1000 if not pd.isna(last["step_time_p50_s"]) else None),
            ("peak mem {:.0f} MiB", last["peak_memory_bytes"] / 2**20),
        ]
        parts = [str(last["strategy"])] + [fmt.format(v) for fmt, v in shown if v is not None and not pd.isna(v)]
        click.echo(f"{spec.run_id}: completed: " + ", ".join(parts))


@main.command()
@site_option
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Show the arrays and their scripts; submit nothing.")
@click.option("--retry-failed", is_flag=True, help="Also resubmit points whose run failed (they resume).")
def sweep(site_name: str, recipe: Path, dry_run: bool, retry_failed: bool) -> None:
    """Submit a recipe's sweep: only the points not yet submitted, as job arrays. Safe to run
    again, by hand or from cron, and twice at once."""
    from hpcrun.recipe import load_recipe
    from hpcrun.site import load_site
    from hpcrun.sweep import schedule

    site = load_site(site_name)
    recipe_file = load_recipe(recipe)
    if recipe_file.sweep is None:
        raise HpcrunError("has no sweep: block (use hpcrun submit)", recipe, "sweep")
    out = schedule(site, recipe_file, dry_run=dry_run, retry_failed=retry_failed)
    click.echo(f"sweep {out.sweep_id} ({out.directory})")
    for label, reason in out.skipped:
        click.echo(f"  skipped  {label}: {reason}")
    for array, labels in out.arrays:
        click.echo(f"  array {array}: " + "; ".join(labels))
    for label in out.deferred:
        click.echo(f"  deferred {label}: no MaxSubmitJobs headroom now; run hpcrun sweep again later")
    if dry_run:
        for script in out.scripts:
            click.echo("#" * 72 + "\n" + script, nl=False)
        return
    click.echo(f"submitted {len(out.submitted)} point(s); {out.already} already submitted; follow with: hpcrun status --site {site.name} {out.sweep_id}")


@main.command()
@site_option
@click.argument("run")
@click.option("--wait", is_flag=True)
def resume(site_name: str, run: str, wait: bool) -> None:
    """Submit RUN again; it continues from its newest complete checkpoint."""
    from hpcrun import backend

    (run_dir,) = _run_dirs(site_name, run)[:1]
    job_id = backend.submit(backend.load_spec(run_dir))
    click.echo(f"resubmitted {run_dir.name} as job {job_id}")
    if wait:
        _wait([run_dir])


@main.command()
@site_option
@click.argument("run", required=False)
def status(site_name: str, run: str | None) -> None:
    """State, nodes, elapsed time and restarts of runs (one scheduler query for all)."""
    from hpcrun.status import statuses

    rows = statuses(_run_dirs(site_name, run))
    if not rows:
        click.echo("no runs")
        return
    sources = sorted({r.source for r in rows})
    if len(rows) > 1:  # a sweep (or all runs) at a glance
        counts: dict[str, int] = {}
        for r in rows:
            key = "done" if r.state == "COMPLETED" else "running" if r.state == "RUNNING" else "pending" if r.state in ("PENDING", "REQUEUED") else "failed"
            counts[key] = counts.get(key, 0) + 1
        click.echo("  ".join(f"{k} {counts.get(k, 0)}" for k in ("done", "running", "pending", "failed")))
    click.echo(f"{'RUN':48} {'JOB':>10} {'STATE':12} {'NODES':12} {'ELAPSED':>8} {'RESTARTS':>8}  REASON")
    for r in rows:
        elapsed = "" if r.elapsed_s is None else f"{r.elapsed_s // 60}:{r.elapsed_s % 60:02d}"
        click.echo(f"{r.run_id:48} {r.job_id:>10} {r.state:12} {r.nodes:12} {elapsed:>8} {r.restarts:>8}  {r.reason}")
    click.echo(f"(from {', '.join(sources)})", err=True)


@main.command()
@site_option
@click.argument("run")
@click.option("--rank", default=0, show_default=True)
@click.option("--follow", is_flag=True, help="Keep printing until the job ends.")
def logs(site_name: str, run: str, rank: int, follow: bool) -> None:
    """Print a rank's log of RUN's latest job."""
    import codecs
    import time as _time

    from hpcrun.status import log_path, statuses

    (run_dir,) = _run_dirs(site_name, run)[:1]
    path = log_path(run_dir, rank)
    offset, text = 0, codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        # ask before reading: once the job has ended, this read is the last and gets every line
        ended = not follow or statuses([run_dir])[0].done
        if path.exists():
            with path.open("rb") as f:  # bytes, decoded across reads: a read may end inside a character
                f.seek(offset)
                chunk = f.read()
                offset += len(chunk)
            click.echo(text.decode(chunk, final=ended), nl=False)
        if ended:
            break
        _time.sleep(1)
    err = log_path(run_dir, rank, stream="err")
    if not follow and err.exists() and err.stat().st_size:
        click.echo(f"--- {err.name} ---\n{err.read_text()}", nl=False)


@main.command()
@site_option
@click.argument("run")
def cancel(site_name: str, run: str) -> None:
    """Cancel RUN (or every run of a sweep id)."""
    from hpcrun.status import cancel as cancel_run

    for run_dir in _run_dirs(site_name, run):
        click.echo(f"cancelled {run_dir.name} (job {cancel_run(run_dir)})")




# the commands that analyse and diagnose live in their own modules and attach to `main`
from hpcrun import cli_diagnostics, cli_results  # noqa: E402,F401

if __name__ == "__main__":  # `python -m hpcrun.cli`: the commands attached themselves to hpcrun.cli's main
    from hpcrun.cli import main as registered

    registered()
