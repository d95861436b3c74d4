"""Training strategies, one module each: its config (validation, per-field docs), its plan-time
checks, its memory-planner accounting, its results columns and how it builds its engine.

Adding a strategy is one module with a `Strategy` subclass, registered here (or by whoever
calls `register` before recipes naming it are validated).
"""

from __future__ import annotations

from hpcrun.strategies.base import REGISTRY, Option, PlanProblem, Strategy, StrategyField, register
from hpcrun.strategies.ddp import DDP
from hpcrun.strategies.deepspeed import DeepSpeed
from hpcrun.strategies.fsdp import FSDP

for _builtin in (DDP, FSDP, DeepSpeed):  # in the order an unknown name's error lists them
    register(_builtin)


def planner_options() -> list[Option]:
    """Every layout the memory planner weighs, in order of preference (least communication first)."""
    seen: dict[str, Option] = {}
    for cls in REGISTRY.values():
        for option in cls.planner_options():
            seen.setdefault(option.name, option)
    return sorted(seen.values(), key=lambda o: o.order)


__all__ = [
    "DDP",
    "FSDP",
    "DeepSpeed",
    "Option",
    "PlanProblem",
    "REGISTRY",
    "Strategy",
    "StrategyField",
    "planner_options",
    "register",
]
