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
        click.echo(
            tabulate(
                table,
                headers="keys",
                tablefmt="github" if fmt == "markdown" else "simple",
                showindex=False,
                floatfmt=".4g",
            )
        )


def _human(table: tp.Any) -> tp.Any:
    """A comparison in the report's units (k tokens/s, %, ms, GB): one format per column."""
    from hpcrun.report import units

    shown = table.copy()
    for column, unit in (("tokens_per_s", units.kilo), ("wall_tokens_per_s", units.kilo),
                         ("recovery_overhead", units.share), ("tokens_per_s_per_gpu", units.kilo),
                         ("mfu", units.percent), ("scaling_efficiency", units.percent),
                         ("step_time_p50_s", units.milliseconds), ("peak_memory_bytes", units.gigabytes)):
        if column in shown.columns:
            shown[column] = [unit(value) for value in shown[column]]
    return shown


tolerance_option = click.option(
    "--tolerance", type=click.FloatRange(min=0), default=None,
    help="Relative loss difference above which strategies disagree (default 1e-3: fp32; use ~1e-2 for bf16/fp16).",
)


@click.group(invoke_without_command=True)
@with_options(results_options)
@click.option(
    "--compare",
    "compare_keys",
    default=None,
    help=(
        "Pivot by these columns, e.g. strategy,nodes; "
        "with the table formats also whether the strategies' losses agree."
    ),
)
@click.option(
    "--format", "fmt", type=click.Choice(["table", "csv", "json", "markdown"]), default="table", show_default=True
)
@tolerance_option
@click.pass_context
def results(
    ctx: click.Context,
    site_name: str,
    results_dir: Path | None,
    sweep: str | None,
    strategy: str | None,
    since: str | None,
    compare_keys: str | None,
    fmt: str,
    tolerance: float | None,
) -> None:
    """Runs' measurements from the Parquet tables; `--compare strategy,nodes` for a comparison."""
    if ctx.invoked_subcommand is not None:
        return
    df = _results_frame(site_name, results_dir, {"sweep_id": sweep, "strategy": strategy}, since)
    if compare_keys:
        from hpcrun.compare import compare

        keys = [k.strip() for k in compare_keys.split(",") if k.strip()]
        table = compare(df, keys)
        _emit(table if fmt in ("csv", "json") else _human(table), fmt)
        for _, row in table[table["mixes"] != ""].iterrows():
            group = ", ".join(f"{k}={row[k]}" for k in keys)
            click.echo(
                f"warning: {group} averages runs that differ in {row['mixes']}: compare like with like", err=True
            )
        if fmt in ("table", "markdown"):  # csv and json stay one machine-readable table
            from hpcrun.compare import AGREE_TOLERANCE
            from hpcrun.site import load_site

            lines = _agreement_lines(
                df,
                _steps_frame(results_dir or load_site(site_name).results_dir, df),
                AGREE_TOLERANCE if tolerance is None else tolerance,
            )
            if lines:
                click.echo("\ndo the strategies agree? (same model, seed, global batch; loss over common steps)")
                click.echo("\n".join(lines))
        return
    columns = [
        "run_id",
        "status",
        "strategy",
        "zero_stage",
        "nodes",
        "world_size",
        "model",
        "tokens_per_s_per_gpu",
        "mfu",
        "step_time_p50_s",
        "peak_memory_bytes",
        "final_loss",
        "attempt",
    ]
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
def results_check(
    site_name: str, results_dir: Path | None, sweep: str | None, strategy: str | None, since: str | None, baseline: Path
) -> None:
    """Compare against recorded references; exit code 1 on a regression."""
    from hpcrun.compare import check, load_baseline

    refs = load_baseline(baseline)
    lines = check(
        _results_frame(site_name, results_dir, {"sweep_id": sweep, "strategy": strategy}, since), refs, baseline
    )
    for line, _ in lines:
        click.echo(line)
    if not all(ok for _, ok in lines):
        raise SystemExit(1)


def _steps_frame(directory: Path, df: tp.Any) -> tp.Any:
    """Per-step rows of the runs in `df` (hpcrun.steps), bad files reported and skipped."""
    import warnings

    from hpcrun.steps import load_steps

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = load_steps(directory, run_id=sorted(set(df["run_id"].dropna())))
    for warning in caught:
        click.echo(f"warning: {warning.message}", err=True)
    return steps


def _agreement_lines(df: tp.Any, steps: tp.Any, tolerance: float) -> list[str]:
    from hpcrun.compare import agreement
    from hpcrun.report.units import missing

    lines = []
    for row in agreement(df, steps, tolerance).itertuples():
        what = (
            f"model={row.model} seed={row.seed} global_batch={row.global_batch} seq_len={row.seq_len}: {row.strategies}"
        )
        if missing(row.agree):
            lines.append(f"NO COMMON STEPS {what}")
        else:
            word = "agree   " if row.agree else "DISAGREE"
            where = f"{row.worst_pair} at step {row.worst_step} over {row.common_steps} common steps"
            lines.append(
                f"{word} {what}: largest loss difference {row.max_abs_diff:.3g} "
                f"({row.max_rel_diff:.2e} relative, tolerance {tolerance:g}), {where}"
            )
    return lines


@click.command()
@with_options(results_options)
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), default=Path("hpcrun-report"), show_default=True
)
@click.option("--title", default="hpcrun report", show_default=True)
@tolerance_option
def report(
    site_name: str,
    results_dir: Path | None,
    sweep: str | None,
    strategy: str | None,
    since: str | None,
    out: Path,
    title: str,
    tolerance: float | None,
) -> None:
    """One self-contained HTML page (OUT/index.html): scaling, throughput, MFU, memory, loss
    curves, step-time spread, whether the strategies agree, and provenance."""
    from hpcrun.compare import AGREE_TOLERANCE
    from hpcrun.report import report as write
    from hpcrun.site import load_site

    df = _results_frame(site_name, results_dir, {"sweep_id": sweep, "strategy": strategy}, since)
    if not (df["status"] == "completed").any():
        raise HpcrunError("no completed runs to draw", field="--dir" if results_dir else "--site")
    steps = _steps_frame(results_dir or load_site(site_name).results_dir, df)
    click.echo(str(write(df, steps, out, title, AGREE_TOLERANCE if tolerance is None else tolerance)))


COMMANDS = [results, report]
