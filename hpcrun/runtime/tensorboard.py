"""TensorBoard event files of the steps table's values (rank 0, `metrics: {tensorboard: true}`).

Imported only when enabled: tensorboard is an optional extra (`pip install hpcrun[tensorboard]`).
A resumed attempt opens its writer with `purge_step` = its first step, so TensorBoard's reader
drops what earlier attempts wrote from that step on: one curve per run, as in the steps table.
"""

from __future__ import annotations

import typing as tp
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

SCALARS = (
    "loss", "lr", "grad_norm", "step_time_s", "step_time_min_s", "step_time_median_s", "step_time_max_s",
    "tokens_per_s", "memory_bytes",
)


class Board:
    def __init__(self, directory: Path, start_step: int) -> None:
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=start_step + 1 if start_step else None)

    def write(self, rows: list[dict[str, tp.Any]]) -> None:
        """Each row's values under their steps-table column names; `ctx.log` values as extra/<name>."""
        for row in rows:
            step, walltime = row["step"], row["time"].timestamp()
            values = {name: row[name] for name in SCALARS} | {f"extra/{k}": v for k, v in row["extra"].items()}
            for name, value in values.items():
                if value is not None:
                    self.writer.add_scalar(name, value, step, walltime=walltime)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
