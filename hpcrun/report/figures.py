"""The report's plots, each drawn by matplotlib (Agg: login nodes have no display) into PNG
bytes that the page embeds. A `Figure` keeps what was plotted (series names and colours) next
to the image, so the page can state it and a test can check the picture against it."""

from __future__ import annotations

import dataclasses
import io
import typing as tp

if tp.TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]


@dataclasses.dataclass(frozen=True)
class Figure:
    """One embedded plot: `series` maps each line's or bar group's name to its colour."""

    name: str
    title: str
    png: bytes
    series: dict[str, str]
    caption: str = ""


def colours(labels: tp.Iterable[str]) -> dict[str, str]:
    """The same strategy has the same colour in every plot of a report."""
    return {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(sorted(set(labels)))}


def _pyplot() -> tp.Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: tp.Any) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    _pyplot().close(fig)
    return buffer.getvalue()


def _nothing(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="#555555")
    ax.set_xticks([])
    ax.set_yticks([])


def scaling(table: pd.DataFrame, palette: dict[str, str]) -> Figure:
    """Total tokens/s against nodes per strategy, and each strategy's ideal: linear from its
    smallest node count; where measured, the wall-clock tokens/s beside it (saves and snapshots
    included), so what recovery costs shows as the gap between the two lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, group in table.dropna(subset=["tokens_per_s"]).groupby("label"):
        group = group.sort_values("nodes")
        nodes = group["nodes"].astype(int).to_numpy()
        rate = group["tokens_per_s"].astype(float).to_numpy() / 1e3
        ax.plot(nodes, rate, marker="o", color=palette[str(label)], label=str(label))
        ax.plot(nodes, rate[0] * nodes / nodes[0], linestyle="--", color=palette[str(label)], alpha=0.45, linewidth=1)
    walled = table.dropna(subset=["wall_tokens_per_s"])
    for label, group in walled.groupby("label"):
        group = group.sort_values("nodes")
        ax.plot(
            group["nodes"].astype(int).to_numpy(), group["wall_tokens_per_s"].astype(float).to_numpy() / 1e3,
            linestyle=":", marker="o", markerfacecolor="white", color=palette[str(label)],
        )
    if len(walled):
        ax.plot([], [], linestyle=":", marker="o", markerfacecolor="white", color="#555555", label="wall clock")
    ax.plot([], [], linestyle="--", color="#555555", label="ideal (linear)")
    ax.set_xticks(sorted(int(n) for n in table["nodes"].dropna().unique()))
    ax.set_xlabel("nodes")
    ax.set_ylabel("k tokens/s (all ranks)")
    ax.set_title("Scaling: throughput against nodes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Figure(
        "scaling",
        "Scaling",
        _png(fig),
        {k: v for k, v in palette.items() if k in set(table["label"])},
        "dashed: ideal linear scaling from each strategy's smallest node count"
        + ("; dotted, open markers: wall-clock tokens/s (saves and snapshots included)" if len(walled) else ""),
    )


def _bars(ax: Axes, table: pd.DataFrame, column: str, scale: float, palette: dict[str, str], ylabel: str) -> bool:
    """Bars per strategy, one per node count side by side; False when nothing was measured."""
    data = table.dropna(subset=[column])
    if data.empty:
        return False
    labels = sorted(data["label"].unique())
    node_counts = sorted(int(n) for n in data["nodes"].unique())
    width = 0.8 / len(node_counts)
    for j, nodes in enumerate(node_counts):
        for i, label in enumerate(labels):
            cell = data[(data["label"] == label) & (data["nodes"] == nodes)]
            if cell.empty:
                continue
            value = float(cell[column].astype(float).iloc[0]) * scale
            x = i + (j - (len(node_counts) - 1) / 2) * width
            ax.bar(
                x,
                value,
                width * 0.95,
                color=palette[label],
                alpha=1.0 - 0.35 * j / max(1, len(node_counts) - 1) if len(node_counts) > 1 else 1.0,
            )
            ax.annotate(f"{nodes}n", (x, value), ha="center", va="bottom", fontsize=7)
    # side by side, seven names like `zero3+nvme` overlap in half a page's width: each option on a line of its own
    ax.set_xticks(range(len(labels)), [label.replace("+", "\n+") for label in labels] if len(labels) > 3 else labels)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    return True


def per_gpu(table: pd.DataFrame, palette: dict[str, str]) -> Figure:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    if not _bars(left, table, "tokens_per_s_per_gpu", 1e-3, palette, "k tokens/s per GPU (rank)"):
        _nothing(left, "no throughput measured")
    left.set_title("Throughput per GPU")
    if not _bars(right, table, "mfu", 100.0, palette, "MFU (%)"):
        _nothing(right, "MFU not measured\n(the partition states no peak FLOPs)")
    right.set_title("Model FLOPs utilisation")
    return Figure(
        "per_gpu",
        "Throughput per GPU and MFU",
        _png(fig),
        palette_of(table, palette),
        "bars labelled with their node count (n)",
    )


def memory(table: pd.DataFrame, palette: dict[str, str]) -> Figure:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    if not _bars(ax, table, "peak_memory_bytes", 1e-9, palette, "peak memory per rank (GB)"):
        _nothing(ax, "no memory measured")
    ax.set_title("Peak memory per strategy")
    return Figure("memory", "Peak memory", _png(fig), palette_of(table, palette))


def step_times(table: pd.DataFrame, palette: dict[str, str]) -> Figure:
    """p50 as a bar, p95 as a tick above it: the spread between them is the jitter."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    if _bars(ax, table, "step_time_p50_s", 1e3, palette, "step time (ms)"):
        data = table.dropna(subset=["step_time_p95_s"])
        labels = sorted(table.dropna(subset=["step_time_p50_s"])["label"].unique())
        node_counts = sorted(int(n) for n in table.dropna(subset=["step_time_p50_s"])["nodes"].unique())
        width = 0.8 / len(node_counts)
        for _, row in data.iterrows():
            if row["label"] not in labels or int(row["nodes"]) not in node_counts:
                continue
            x = labels.index(row["label"]) + (node_counts.index(int(row["nodes"])) - (len(node_counts) - 1) / 2) * width
            ax.errorbar(
                x,
                float(row["step_time_p50_s"]) * 1e3,
                yerr=[[0], [max(0.0, float(row["step_time_p95_s"] - row["step_time_p50_s"])) * 1e3]],
                color="black",
                capsize=4,
                linewidth=1,
            )
    else:
        _nothing(ax, "no step times measured")
    ax.set_title("Step time: p50 (bar) to p95 (whisker)")
    return Figure("step_times", "Step-time spread", _png(fig), palette_of(table, palette))


def palette_of(table: pd.DataFrame, palette: dict[str, str]) -> dict[str, str]:
    present = set(table["label"])
    return {k: v for k, v in palette.items() if k in present}


def losses(curves: dict[str, pd.DataFrame], palette: dict[str, str], name: str, title: str, caption: str) -> Figure:
    """Loss against step, one line per strategy on one axis. Strategies that agree draw the
    same curve, so the lines get thinner in drawing order: each stays visible as a coloured
    band around the ones drawn after it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    n = len(curves)
    for i, (label, curve) in enumerate(sorted(curves.items())):
        ax.plot(
            curve["step"].astype(int),
            curve["loss"].astype(float),
            color=palette[label],
            label=label,
            linewidth=1.5 + 2.0 * (n - 1 - i),
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Figure(name, title, _png(fig), {label: palette[label] for label in sorted(curves)}, caption)
