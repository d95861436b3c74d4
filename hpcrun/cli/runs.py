"""`hpcrun status`, `hpcrun logs`, `hpcrun cancel`, `hpcrun checkpoint`: following and handling
runs that were sent."""

from __future__ import annotations

from pathlib import Path

import click

from hpcrun.cli.options import one_run, run_dirs, site_option
from hpcrun.errors import HpcrunError
from hpcrun.rundir import RunDir


@click.command()
@site_option
@click.argument("run", required=False)
@click.option(
    "--wait",
    is_flag=True,
    help="Follow the runs to their end (Ctrl-C stops following, never the jobs); exit non-zero if one failed.",
)
@click.option("--timeout", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="With --wait: stop following after SECONDS, exit status 124 if a run has not ended.")
def status(site_name: str, run: str | None, wait: bool, timeout: float | None) -> None:
    """State, nodes, elapsed time, requeues and restarts inside the job and, while training, step
    of total, tokens/s, ETA and newest checkpoint of runs (one scheduler query for all, shared with this user's other
    hpcrun processes). RUN may be a run id, a sweep id or a unique prefix; without it, every run."""
    import time

    from hpcrun.progress import counts_line, duration, live, rate
    from hpcrun.status import goodput_line, statuses

    if timeout is not None and not wait:
        raise HpcrunError("--timeout only bounds --wait", field="--timeout")
    dirs = run_dirs(site_name, run, many=True)
    if wait:  # following polls the scheduler itself: no query here first
        from hpcrun.cli.submission import follow

        submitted = [Path(d) for d in dirs if RunDir(d).latest_job()]  # dry runs have nothing to follow
        if not submitted:
            click.echo("no runs")
            return
        follow(submitted, timeout)
        return
    rows = statuses(dirs)
    if not rows:  # none, or only dry runs
        click.echo("no runs")
        return
    sources = sorted({r.source for r in rows})
    if len(rows) > 1:  # a sweep (or all runs) at a glance
        click.echo(counts_line(rows))
    width = max(24, *(len(r.run_id) for r in rows))
    now = time.time()
    lines = [
        f"{'RUN':{width}} {'JOB':>10} {'STATE':12} {'NODES':12} {'ELAPSED':>8} {'REQUEUES':>8} {'IN-JOB':>6} "
        f"{'STEP':>13} {'%':>4} {'TOK/S':>6} {'ETA':>8} {'CKPT':>6}  REASON"
    ]
    for r in rows:
        p = r.progress
        step = f"{p.step}/{p.total}" if p else ""
        percent = f"{p.percent:.0f}" if p and p.percent is not None else ""
        tokens = rate(p.tokens_per_s) if p and live(r) else ""
        eta = duration(p.eta_now(now)) if p and live(r) else ""
        ckpt = "" if p is None or p.checkpoint_step is None else str(p.checkpoint_step)
        scheduled = (
            f"{r.run_id:{width}} {r.job_id:>10} {r.state:12} {r.nodes:12} {duration(r.elapsed_s):>8} "
            f"{r.requeues:>8} {r.in_job:>6}"
        )
        lines.append(f"{scheduled} {step:>13} {percent:>4} {tokens:>6} {eta:>8} {ckpt:>6}  {r.reason}".rstrip())
    if len(rows) == 1 and rows[0].progress:  # one run: how its saves are spaced, and why
        lines += [f"  {line}" for line in rows[0].progress.saves]
    if len(rows) == 1:  # one run: what its failures cost
        found = next((goodput_line(Path(d), rows[0]) for d in dirs if Path(d).name == rows[0].run_id), None)
        lines += [f"  {found}"] if found else []
    click.echo("\n".join(lines))
    click.echo(f"(from {', '.join(sources)})", err=True)


@click.command()
@site_option
@click.argument("run")
@click.option("--rank", default=0, show_default=True)
@click.option("--follow", is_flag=True, help="Keep printing until the job ends.")
def logs(site_name: str, run: str, rank: int, follow: bool) -> None:
    """Print a rank's log of RUN's latest job."""
    from hpcrun.logs import log_path, read

    run_dir = one_run(site_name, run)
    for text in read(run_dir, rank, follow):
        click.echo(text, nl=False)
    err = log_path(run_dir, rank, stream="err")
    if not follow and err.exists() and err.stat().st_size:
        click.echo(f"--- {err.name} ---\n{err.read_text()}", nl=False)


@click.command()
@site_option
@click.argument("run")
def cancel(site_name: str, run: str) -> None:
    """Cancel RUN (or every run of a sweep id or staged submission)."""
    from hpcrun.cancel import NOTHING, already_ended, cancel_all

    dirs = run_dirs(site_name, run, many=True)
    cancelled, skipped, ended = cancel_all(dirs)
    if len(dirs) == 1 and not cancelled:
        raise HpcrunError(NOTHING, skipped[0]) if skipped else HpcrunError(already_ended(*ended[0]))
    if skipped and not cancelled and not ended:
        raise HpcrunError("none of these runs has a submitted job (dry runs?), so there is nothing to cancel")
    for run_dir, job in cancelled:
        click.echo(f"cancelled {run_dir.name} (job {job})")
    for run_dir, job, state in ended:
        click.echo(f"not cancelled {already_ended(run_dir, job, state)}")
    for run_dir in skipped:
        click.echo(f"not cancelled {run_dir.name}: no job was submitted (a dry run?)")


@click.group()
def checkpoint() -> None:
    """Work with a run's checkpoints."""


@checkpoint.command("consolidate")
@site_option
@click.argument("run")
@click.option("--step", type=int, default=None, help="Which complete checkpoint (default: the newest).")
def checkpoint_consolidate(site_name: str, run: str, step: int | None) -> None:
    """Write one fp32 state dict from RUN's sharded (DCP or ZeRO) checkpoint."""
    from hpcrun.rundir import RunDir
    from hpcrun.runtime.checkpoint import (  # torch: this command is for after the run
        complete,
        consolidate,
    )

    run_dir = one_run(site_name, run)
    steps = [number for number, _ in complete(RunDir(run_dir).checkpoints)]
    if not steps:
        raise HpcrunError("no complete checkpoint to consolidate", run_dir)
    if step is not None and step not in steps:
        raise HpcrunError(
            f"no complete checkpoint at step {step} in {run_dir.name} (complete steps: {', '.join(map(str, steps))})",
            field="--step",
        )
    path, digest = consolidate(run_dir, step)
    click.echo(f"{path}  sha256 of weights {digest}")


COMMANDS = [status, logs, cancel, checkpoint]
