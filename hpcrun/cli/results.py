"""`hpcrun results` (table, comparison, compaction, regression check) and `hpcrun report`: what
the runs measured."""

from __future__ import annotations

import typing as tp
from pathlib import Path

import click

from hpcrun.cli.options import results_options, site_option, with_options
from hpcrun.errors import HpcrunError


def _results_frame(site_name: str, results_dir: Path | None, filters: dict[str, tp.Any], since: str | None) -> tp.Any:
    import warnings

    import pandas as pd

    from hpcrun.results import load
    from hpcrun.site import load_site

    directory = results_dir or load_site(site_name).results_dir
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load(directory, **{k: v for k, v in filters.items() if v is not None})
    for warning in caught:  # a bad file is reported and skipped, never fatal
        click.echo(f"warning: {warning.message}", err=True)
    if since:
        try:
            df = df[df["start_time"] >= pd.Timestamp(since, tz="UTC")]
        except ValueError as exc:
            raise HpcrunError(f"not a date or time ({since!r})", field="--since") from exc
    return df


def _emit(df: tp.Any, fmt: str) -> None:
    from tabulate import tabulate

    if fmt == "csv":
        click.echo(df.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(df.to_json(orient="records", date_format="iso", indent=1))
    else:
        table = df.astype(object).where(df.notna(), "")
        click.echo(tabulate(table, headers="keys", tablefmt="github" if fmt == "markdown" else "simple", showindex=False, floatfmt=".4g"))


@click.group(invoke_without_command=True)
@with_options(results_options)
@click.option("--compare", "compare_keys", default=None, help="Pivot by these columns, e.g. strategy,nodes.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json", "markdown"]), default="table", show_default=True)
@click.pass_context
def results(ctx: click.Context, site_name: str, results_dir: Path | None, sweep: str | None, strategy: str | None, since: str | None, compare_keys: str | None, fmt: str) -> None:
    """Runs' measurements from the Parquet tables; `--compare strategy,nodes` for a comparison."""
    if ctx.invoked_subcommand is not None:
        return
    df = _results_frame(site_name, results_dir, {"sweep_id": sweep, "strategy": strategy}, since)
    if compare_keys:
        from hpcrun.compare import compare

        _emit(compare(df, [k.strip() for k in compare_keys.split(",") if k.strip()]), fmt)
        return
    columns = ["run_id", "status", "strategy", "zero_stage", "nodes", "world_size", "model", "tokens_per_s_per_gpu", "mfu", "step_time_p50_s", "peak_memory_bytes", "final_loss", "restart_count"]
    _emit(df[columns] if fmt in ("table", "markdown") else df, fmt)


@results.command("compact")
@site_option
@click.option("--dir", "results_dir", type=click.Path(file_okay=False, path_type=Path), default=None)
def results_compact(site_name: str, results_dir: Path | None) -> None:
    """Merge the small per-attempt files into one (safe while jobs keep writing)."""
    from hpcrun.results import compact
    from hpcrun.site import load_site

    merged, rows = compact(results_dir or load_site(site_name).results_dir)
    click.echo(f"merged {merged} files ({rows} rows)")


@results.command("check")
@with_options(results_options)
@click.option("--baseline", type=click.Path(dir_okay=False, path_type=Path), required=True, help="YAML of references.")
def results_check(site_name: str, results_dir: Path | None, sweep: str | None, strategy: str | None, since: str | None, baseline: Path) -> None:
    """Compare against recorded references; exit code 1 on a regression."""
    from hpcrun.compare import check, load_baseline

    refs = load_baseline(baseline)
    lines = check(_results_frame(site_name, results_dir, {"sweep_id": sweep, "strategy": strategy}, since), refs, baseline)
    for line, _ in lines:
        click.echo(line)
    if not all(ok for _, ok in lines):
        raise SystemExit(1)


@click.command()
@with_options(results_options)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("hpcrun-report"), show_default=True)
def report(site_name: str, results_dir: Path | None, sweep: str | None, strategy: str | None, since: str | None, out: Path) -> None:
    """Draw throughput and MFU against nodes and peak memory per strategy (PNG + HTML)."""
    from hpcrun.report import report as draw

    df = _results_frame(site_name, results_dir, {"sweep_id": sweep, "strategy": strategy}, since)
    if not (df["status"] == "completed").any():
        raise HpcrunError("no completed runs to draw", field="--dir" if results_dir else "--site")
    for path in draw(df, out):
        click.echo(str(path))


COMMANDS = [results, report]
