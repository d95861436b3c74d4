"""hpcrun: render, submit and requeue multi-node PyTorch training on SLURM, and compare the runs."""

from __future__ import annotations

import importlib
import typing as tp

__version__ = "0.1.0"

__all__ = ["Executor", "__version__"]


def __getattr__(name: str) -> tp.Any:
    """`hpcrun.Executor`, submitit's executor over hpcrun (hpcrun.executor.HpcrunExecutor), imported
    on first use: importing hpcrun alone loads neither submitit nor the planner, and the package
    root, which every module imports for its version, imports none of them back."""
    if name == "Executor":
        return importlib.import_module("hpcrun.executor").HpcrunExecutor
    raise AttributeError(f"module 'hpcrun' has no attribute {name!r}")
