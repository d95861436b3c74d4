"""The report page: one self-contained HTML file (plots embedded as data: URIs, styles inline,
no scripts, nothing fetched) that can be mailed to a colleague or opened from a login node."""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
import typing as tp
from pathlib import Path

from hpcrun.compare import AGREE_KEYS, AGREE_TOLERANCE, agreement, strategy_label
from hpcrun.report import figures, units
from hpcrun.report.figures import Figure

if tp.TYPE_CHECKING:
    import pandas as pd

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1100px;color:#222;
padding:0 1em}
h1{margin-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.sub{color:#666;margin-top:0}table{border-collapse:collapse;margin:.6em 0;font-size:14px}
th,td{padding:.3em .7em;border-bottom:1px solid #e4e4e4;text-align:right}th{background:#f5f5f5}
td.t,th.t{text-align:left}figure{display:inline-block;margin:.4em 1em .4em 0;vertical-align:top}
figcaption{color:#666;font-size:13px;max-width:640px}img{max-width:100%}
.bad{background:#fde2e1;font-weight:600}.good{background:#e6f4e6}.swatch{display:inline-block;width:.8em;height:.8em;margin-right:.3em;border-radius:2px}
"""


# under the summary table: its two throughputs differ by what recovery costs, and a reader must know which is which
WALL_CLOCK = (
    "tokens/s: per step after the warm-up, stalls for checkpoint saves and in-memory snapshots excluded; "
    "wall-clock tokens/s: over the training loop's wall time for the same steps, those stalls included; "
    "lost to saves/snapshots: the share of that wall time the training thread stalled in saves and snapshots."
)


def _table(header: list[str], rows: list[list[str]], left: int = 1, classes: list[str] | None = None) -> str:
    head = "".join(
        f'<th class="t">{html.escape(h)}</th>' if i < left else f"<th>{html.escape(h)}</th>"
        for i, h in enumerate(header)
    )
    body = []
    for r, row in enumerate(rows):
        cls = f' class="{classes[r]}"' if classes and classes[r] else ""
        cells = "".join(f'<td class="t">{c}</td>' if i < left else f"<td>{c}</td>" for i, c in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _e(value: tp.Any) -> str:
    return html.escape(units.plain(value))


def summary_table(done: pd.DataFrame) -> pd.DataFrame:
    """Completed runs per (strategy, nodes): means of rates, medians of step times, the largest
    memory, and scaling efficiency per GPU against the strategy's smallest node count."""
    grouped = done.groupby(["label", "nodes"], dropna=False)
    table = grouped.agg(
        world_size=("world_size", "max"),
        runs=("run_id", "nunique"),
        tokens_per_s=("tokens_per_s", "mean"),
        wall_tokens_per_s=("wall_tokens_per_s", "mean"),
        recovery_overhead=("recovery_overhead", "mean"),
        tokens_per_s_per_gpu=("tokens_per_s_per_gpu", "mean"),
        mfu=("mfu", "mean"),
        step_time_p50_s=("step_time_p50_s", "median"),
        step_time_p95_s=("step_time_p95_s", "median"),
        peak_memory_bytes=("peak_memory_bytes", "max"),
        final_loss=("final_loss", "mean"),
        attempt=("attempt", "max"),  # the highest attempt number that completed
    ).reset_index()
    base = table.sort_values("nodes").groupby("label")["tokens_per_s_per_gpu"].first()
    first = {str(k): v for k, v in base.items()}
    table["scaling_efficiency"] = [
        row.tokens_per_s_per_gpu / first[str(row.label)]
        if not units.missing(row.tokens_per_s_per_gpu)
        and not units.missing(first[str(row.label)])
        and first[str(row.label)]
        else None
        for row in table.itertuples()
    ]
    return table.sort_values(["label", "nodes"]).reset_index(drop=True)


def _img(figure: Figure) -> str:
    data = base64.b64encode(figure.png).decode()
    series = html.escape(json.dumps(figure.series), quote=True)
    names = ", ".join(figure.series)
    alt = html.escape(f"{figure.title}: {names}" if names else figure.title, quote=True)
    caption = f"<figcaption>{html.escape(figure.caption)}</figcaption>" if figure.caption else ""
    return (
        f'<figure><img src="data:image/png;base64,{data}" alt="{alt}" '
        f'data-figure="{figure.name}" data-series="{series}">{caption}</figure>'
    )


def _loss_figures(
    done: pd.DataFrame, steps: pd.DataFrame, agree: pd.DataFrame, palette: dict[str, str]
) -> list[Figure]:
    """One loss plot per group of runs that trained the same model (the agreement check's
    groups), one line per strategy: the newest run of each."""
    if steps.empty:
        return []
    keys = [k for k in AGREE_KEYS if k in done.columns]
    made = []
    for i, (key, group) in enumerate(done.sort_values("start_time").groupby(keys, dropna=False)):
        newest = group.drop_duplicates("label", keep="last")
        curves = {}
        for row in newest.itertuples():
            curve = steps[steps["run_id"] == row.run_id].dropna(subset=["loss"]).sort_values("step")
            if not curve.empty:
                curves[str(row.label)] = curve.drop_duplicates("step", keep="last")
        if not curves:
            continue
        values = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        title = "Loss: " + ", ".join(f"{k.replace('_', ' ')} {units.plain(v)}" for k, v in values.items())
        verdict = ""
        match = agree
        for k, v in values.items():
            match = match[match[k].isna()] if units.missing(v) else match[match[k] == v]
        if len(match):
            m = match.iloc[0]
            verdict = (
                f"largest difference between strategies over their first {units.plain(m['window'])} steps: "
                f"{units.plain(m['max_rel_diff'], '{:.2e}')} relative ({m['worst_pair']}, step "
                f"{units.plain(m['worst_step'])})"
            )
            if not units.missing(m["drift_rel_diff"]):  # shown, not judged: reassociation grows later
                verdict += f"; after them up to {units.plain(m['drift_rel_diff'], '{:.2e}')}"
        made.append(figures.losses(curves, palette, f"loss-{i}", title, verdict))
    return made


def _agreement_html(agree: pd.DataFrame) -> str:
    if agree.empty:
        return (
            "<p>No group of completed runs trained the same model (same model, seed, global batch and sequence length) "
            "with two or more strategies and logged per-step losses.</p>"
        )
    rows, classes = [], []
    for row in agree.itertuples():
        verdict = "no common steps" if units.missing(row.agree) else "agree" if row.agree else "DISAGREE"
        classes.append("good" if verdict == "agree" else "bad")
        rows.append(
            [
                verdict,
                _e(row.model),
                _e(row.strategies),
                _e(row.worst_pair),
                _e(row.seed),
                _e(row.global_batch),
                _e(row.seq_len),
                _e(row.common_steps),
                _e(units.plain(row.max_abs_diff, "{:.3g}")),
                html.escape(units.plain(row.max_rel_diff, "{:.2e}")),
                _e(row.worst_step),
                html.escape(units.plain(row.drift_rel_diff, "{:.2e}")),
                _e(row.drift_step),
                _e(row.exceeds_step),
            ]
        )
    tol, window = float(agree["tolerance"].iloc[0]), int(agree["window"].iloc[0])
    return (
        "<p>Same model, seed and global batch should give the same loss whatever the strategy. "
        f"Judged over the first {window} steps all runs logged: the largest difference there, "
        f"flagged above a relative tolerance of {tol:g}. A fault (gradient scale, data order) shows within "
        "a few steps; later, correct runs drift apart smoothly as floating-point reassociation grows "
        "once the model memorises, so the largest difference after the window and the first step "
        "over the tolerance are shown, not judged.</p>"
        + _table(
            [
                "verdict",
                "model",
                "strategies",
                "worst pair",
                "seed",
                "global batch",
                "seq len",
                "steps judged",
                "max |Δloss|",
                "max relative",
                "at step",
                "after: max relative",
                "at step",
                "over tolerance from step",
            ],
            rows,
            left=4,
            classes=classes,
        )
    )


def _goodput_html(summary: pd.DataFrame) -> str:
    """Per run with a failed attempt: its goodput and the seconds its failures lost, by cause
    (hpcrun.goodput); nothing for a report whose runs never failed."""
    from hpcrun.goodput import goodput

    failed = summary["status"].eq("failed").fillna(False).astype(bool)
    rows = []
    for run_id in sorted(str(r) for r in summary.loc[failed, "run_id"].dropna().unique()):
        attempts = summary[summary["run_id"] == run_id]
        found = goodput(attempts.to_dict("records"))
        if found is None:
            continue
        lost = (found.detect_s, found.restart_s, found.recompute_s, found.queue_s)
        rows.append([_e(run_id), _e(len(attempts)), _e(found.failures), units.percent(found.goodput),
                     *(f"{s:.0f} s" for s in lost)])
    if not rows:
        return ""
    header = ["run", "attempts", "failed", "goodput", "detecting", "restarting", "recomputing", "in the queue"]
    return (
        "<h2>Failures and goodput</h2>" + _table(header, rows)
        + '<p class="sub">goodput: training time over wall time (first start to last end); the seconds lost to '
        "detecting each failure, restarting after it, recomputing the steps it undid, and waiting between "
        "attempts. The rest of what is lost goes to saves and start-up.</p>"
    )


def _provenance(done: pd.DataFrame) -> str:
    def values(column: str) -> str:
        if column not in done.columns:
            return units.DASH
        found = sorted({str(v) for v in done[column] if not units.missing(v)})
        return html.escape(", ".join(found)) if found else units.DASH

    facts = [
        ("site", "site"),
        ("cluster", "cluster"),
        ("partition", "partition"),
        ("sweep", "sweep_id"),
        ("model", "model"),
        ("precision", "precision"),
        ("hpcrun", "hpcrun_version"),
        ("torch", "torch_version"),
        ("DeepSpeed", "deepspeed_version"),
        ("NCCL", "nccl_version"),
        ("git sha", "git_sha"),
    ]
    head = _table(["", "value"], [[html.escape(name), values(col)] for name, col in facts], left=2)
    runs = [
        [_e(r.run_id), _e(r.label), _e(r.nodes), _e(r.job_id), _e(r.node_list), _e(r.attempt), _e(r.start_time)]
        for r in done.sort_values(["label", "nodes"]).itertuples()
    ]
    return head + _table(["run", "strategy", "nodes", "job", "node list", "attempt", "started"], runs, left=5)


def render(
    summary: pd.DataFrame, steps: pd.DataFrame, title: str = "hpcrun report", tolerance: float = AGREE_TOLERANCE
) -> str:
    """The page's HTML for the completed runs of `summary` and their per-step rows `steps`."""
    done = summary[summary["status"] == "completed"].copy()
    done["label"] = strategy_label(done)
    palette = figures.colours(done["label"])
    table = summary_table(done)
    agree = agreement(summary, steps, tolerance)
    plots = [
        figures.scaling(table, palette),
        figures.per_gpu(table, palette),
        figures.memory(table, palette),
        figures.step_times(table, palette),
    ]
    loss = _loss_figures(done, steps, agree, palette)
    rows = [
        [
            f'<span class="swatch" style="background:{palette[str(r.label)]}"></span>{html.escape(str(r.label))}',
            _e(r.nodes),
            _e(r.world_size),
            _e(r.runs),
            units.kilo(r.tokens_per_s),
            units.kilo(r.wall_tokens_per_s),
            units.share(r.recovery_overhead),
            units.kilo(r.tokens_per_s_per_gpu),
            units.percent(r.mfu),
            units.percent(r.scaling_efficiency, 0),
            units.milliseconds(r.step_time_p50_s),
            units.milliseconds(r.step_time_p95_s),
            units.gigabytes(r.peak_memory_bytes),
            _e(units.plain(r.final_loss, "{:.4f}")),
            _e(r.attempt),
        ]
        for r in table.itertuples()
    ]
    when = (
        f"{len(done)} completed runs of {len(summary)} attempts · "
        f"made {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    loss_html = "".join(_img(f) for f in loss) or "<p>No per-step losses were recorded for these runs.</p>"
    header = [
        "strategy", "nodes", "ranks", "runs", "tokens/s", "wall-clock tokens/s", "lost to saves/snapshots",
        "tokens/s per GPU", "MFU", "scaling eff.", "step p50", "step p95", "peak memory", "final loss", "attempt (max)",
    ]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<link rel="icon" href="data:,"><style>{STYLE}</style></head>
<body><h1>{html.escape(title)}</h1><p class="sub">{html.escape(when)}</p>
<h2>Summary</h2>
{_table(header, rows)}
<p class="sub">{html.escape(WALL_CLOCK)}</p>
{_goodput_html(summary)}
<h2>Scaling and throughput</h2>
{"".join(_img(f) for f in plots[:2])}
<h2>Loss curves</h2>
{loss_html}
<h2>Do the strategies agree?</h2>
{_agreement_html(agree)}
<h2>Memory and step time</h2>
{"".join(_img(f) for f in plots[2:])}
<h2>Provenance</h2>
{_provenance(done)}
</body></html>
"""


def report(
    summary: pd.DataFrame,
    steps: pd.DataFrame,
    out: Path,
    title: str = "hpcrun report",
    tolerance: float = AGREE_TOLERANCE,
) -> Path:
    """Write `out/index.html` (the whole report in one file) and return its path."""
    from hpcrun.rundir import atomic_write

    out.mkdir(parents=True, exist_ok=True)
    page = out / "index.html"
    atomic_write(page, render(summary, steps, title, tolerance))
    return page
