"""What a strategy and the engine it builds agree on, as Protocols: the recipe settings they read,
the optimizer factory they are given and the engine the training loop drives.

The recipe imports the strategies (its `strategy:` field) and the runtime implements the engines;
with these shapes declared here, neither side imports the other, not even for its types. This
module imports nothing of hpcrun's, and torch only for type checking.
"""

from __future__ import annotations

import typing as tp
from pathlib import Path

if tp.TYPE_CHECKING:
    import torch
    from torch import nn


class TrainingSettings(tp.Protocol):
    """The part of a recipe's `training:` block an engine applies itself (hpcrun.recipe.Training)."""

    @property
    def micro_batch(self) -> int: ...
    @property
    def grad_accum(self) -> int: ...
    @property
    def grad_clip(self) -> float | None: ...


class Settings(tp.Protocol):
    """What a strategy and its engine read of the recipe they run (hpcrun.recipe.Recipe)."""

    @property
    def precision(self) -> str: ...
    @property
    def training(self) -> TrainingSettings: ...


class OptimizerFactory(tp.Protocol):
    """Builds the optimizer over the parameters the strategy's wrapper exposes."""

    def __call__(self, parameters: tp.Iterable[nn.Parameter], /) -> torch.optim.Optimizer: ...


class Engine(tp.Protocol):
    """The training loop's view of a wrapped model: a micro-step, an optimizer step, a save and
    load of the full training state into a directory, and the whole model's weights."""

    model: nn.Module
    optimizer: tp.Any

    def micro_step(self, tokens: torch.Tensor, targets: torch.Tensor, last: bool, weight: float = 1.0) -> float: ...
    def optimizer_step(self) -> None: ...
    def save(self, directory: Path) -> None: ...
    def load(self, directory: Path) -> None: ...
    def full_state(self) -> dict[str, torch.Tensor]: ...
