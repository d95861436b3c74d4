"""Peaks the site's own results tables measured for what `hpcrun plan` estimates: the planner
checks itself against runs of the same model and shape on the same kind of GPU."""

from __future__ import annotations

from pathlib import Path

from hpcrun.plan import RunSpec


def measured_peaks(spec: RunSpec) -> dict[str, int]:
    """The largest `peak_memory_bytes` per planner option (`plan_option`) among the site's rows of
    `spec`'s model, precision, micro-batch, sequence length, activation checkpointing, nodes, world
    size and GPU model. Rows written before those columns existed match nothing."""
    if spec.model is None or not Path(spec.results_dir).is_dir():
        return {}
    from hpcrun.results import load  # pandas: only when there are tables to read

    t = spec.recipe.training
    rows = load(
        spec.results_dir,
        model=spec.model,
        precision=spec.recipe.precision,
        micro_batch=t.micro_batch,
        seq_len=t.seq_len,
        activation_checkpointing=int(t.activation_checkpointing),
        nodes=spec.nodes,
        world_size=spec.world_size,
        gpu_model=spec.gpu_model,
    )
    rows = rows[rows["plan_option"].notna() & rows["peak_memory_bytes"].notna()]
    return {str(k): int(v) for k, v in rows.groupby("plan_option")["peak_memory_bytes"].max().items()}
