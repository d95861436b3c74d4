"""Pictures of a results table: throughput and MFU against nodes per strategy, peak memory per
strategy, as PNG files and an HTML page that embeds them."""

from __future__ import annotations

import html
import typing as tp
from pathlib import Path

if tp.TYPE_CHECKING:
    import pandas as pd


def report(df: pd.DataFrame, out: Path, title: str = "hpcrun report") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # login nodes have no display
    import matplotlib.pyplot as plt

    from hpcrun.compare import compare

    out.mkdir(parents=True, exist_ok=True)
    table = compare(df, ["strategy", "nodes"])
    made = []
    for metric, label, name in (
        ("tokens_per_s_per_gpu", "tokens/s per GPU (rank)", "throughput.png"),
        ("mfu", "MFU", "mfu.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for strategy, group in table.groupby("strategy"):
            ax.plot(group["nodes"].astype(int), group[metric].astype(float), marker="o", label=str(strategy))
        ax.set_xlabel("nodes")
        ax.set_ylabel(label)
        ax.set_title(f"{label} against nodes")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        made.append(out / name)
    memory = table.groupby("strategy")["peak_memory_bytes"].max().astype(float) / 2**20
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(s) for s in memory.index], [float(v) for v in memory])
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title("peak memory per strategy")
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=100)
    plt.close(fig)
    made.append(out / "memory.png")
    rows = table.to_html(index=False, float_format=lambda v: f"{v:.4g}")
    images = "\n".join(f'<img src="{p.name}" alt="{p.stem}">' for p in made)
    page = f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body><h1>{html.escape(title)}</h1>\n{images}\n{rows}\n</body></html>\n"
    (out / "index.html").write_text(page)
    return [*made, out / "index.html"]
