"""`hpcrun submit`, `hpcrun sweep`, `hpcrun resume`: sending work to a site."""

from __future__ import annotations

from pathlib import Path

import click

from hpcrun.cli.options import one_run, site_option
from hpcrun.errors import HpcrunError


@click.command()
@site_option
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Write the run directory and script; do not call sbatch.")
@click.option("--wait", is_flag=True, help="Follow the job to its end; exit non-zero if it failed.")
@click.option("--run-id", default=None, help="Use this run id (re-using an unfinished run's id continues it).")
def submit(site_name: str, recipe: Path, dry_run: bool, wait: bool, run_id: str | None) -> None:
    """Submit RECIPE to a site (stages in order, with dependencies)."""
    from hpcrun import api
    from hpcrun.rundir import RunDir
    from hpcrun.site import load_site

    site = load_site(site_name)

    def said(run: api.Run) -> None:  # as each goes out: a later stage's refusal keeps the earlier lines
        if dry_run:
            click.echo(f"dry run: {RunDir(run.path).script}")
        else:
            click.echo(f"submitted {run.run_id} as job {run.job_id} ({site.name})\n  run dir: {run.path}")

    runs = api.submit(recipe, site_name, run_id=run_id, dry_run=dry_run, on_each=said)
    submitted = [] if dry_run else runs
    if submitted:
        click.echo(
            f"  follow:  hpcrun status --site {site.name} {submitted[-1].run_id}; "
            f"hpcrun logs --site {site.name} {submitted[-1].run_id} --follow"
        )
    if wait and submitted:
        follow([run.path for run in submitted])


class WaitTimeout(HpcrunError):
    """`--wait --timeout` ran out: its own exit status (timeout(1)'s), apart from a failed run's 1."""

    exit_code = 124


def follow(run_dirs: list[Path], timeout: float | None = None) -> None:
    """Follow the runs to their end: a live bar per run on a terminal, a plain line now and then
    otherwise, counts for many runs (progress.display); then each run's result, or for many runs
    where to find them. Ctrl-C stops following, never the jobs; so does `timeout` (WaitTimeout)."""
    from hpcrun import jobstate
    from hpcrun.progress import MANY_RUNS, display
    from hpcrun.status import wait

    shown = display(runs=len(run_dirs))
    try:
        current = wait(run_dirs, timeout=timeout, on_poll=shown.show)
    except KeyboardInterrupt:
        shown.close()
        click.echo(f"\nleft the job running; reattach with: hpcrun status {run_dirs[-1]}", err=True)
        raise SystemExit(130) from None
    shown.close()
    going = [s for s in current if not s.done]
    if going:  # wait returns early only at the timeout
        first = going[0]
        raise WaitTimeout(f"--timeout {timeout:g} s passed with {len(going)} of {len(current)} runs not ended "
                          f"({first.run_id}: {first.state}); the jobs go on")
    if len(run_dirs) > MANY_RUNS:
        click.echo(f"{len(run_dirs)} runs ended; their rows: hpcrun results (--sweep for a sweep's)")
    else:
        _print_results(run_dirs)
    if any(jobstate.phase(s.state) is not jobstate.Phase.SUCCEEDED for s in current):
        raise SystemExit(1)


def _print_results(run_dirs: list[Path]) -> None:
    import pandas as pd

    from hpcrun.backend import load_spec
    from hpcrun.results import load

    tables: dict[str, pd.DataFrame] = {}  # one read per results directory, however many runs (a sweep)
    for run_dir in run_dirs:
        spec = load_spec(run_dir)
        where = str(spec.site.results_dir)
        if where not in tables:
            tables[where] = load(where)
        table = tables[where]
        df = table[table["run_id"] == spec.run_id] if len(table) else table
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


@click.command()
@site_option
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Show the arrays and their scripts; submit nothing.")
@click.option("--retry-failed", is_flag=True, help="Also resubmit points whose run failed (they resume).")
def sweep(site_name: str, recipe: Path, dry_run: bool, retry_failed: bool) -> None:
    """Submit a recipe's sweep: only the points not yet submitted, as job arrays. Safe to run
    again, by hand or from cron, and twice at once."""
    from hpcrun.campaign import schedule
    from hpcrun.recipe import load_recipe
    from hpcrun.site import load_site

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
        click.echo(f"  deferred {label}: no room under {out.cap} now; run hpcrun sweep again later")
    for label, job in out.found:
        click.echo(f"  found    {label}: job {job} (sbatch's answer was lost; SLURM has the job under its tag)")
    for label in out.waiting:
        click.echo(f"  waiting  {label}: sent, its answer lost, no job seen yet; run hpcrun sweep again later")
    if dry_run:
        for script in out.scripts:
            click.echo("#" * 72 + "\n" + script, nl=False)
        return
    click.echo(
        f"submitted {len(out.submitted)} point(s); {out.already} already submitted; "
        f"follow with: hpcrun status --site {site.name} {out.sweep_id}"
    )


@click.command()
@site_option
@click.argument("run")
@click.option("--wait", is_flag=True)
def resume(site_name: str, run: str, wait: bool) -> None:
    """Submit RUN again; it continues from its newest complete checkpoint. Refused while the
    run's latest job has not ended."""
    from hpcrun import api

    run_dir = one_run(site_name, run)
    job_id = api.resume(api.Run(run_dir))
    click.echo(f"resubmitted {run_dir.name} as job {job_id}")
    if wait:
        follow([run_dir])


COMMANDS = [submit, sweep, resume]
