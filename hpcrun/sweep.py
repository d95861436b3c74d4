"""Sweep expansion: the matrix of a recipe's `sweep.axes`, less `exclude`, plus `include`, and the
stable ids of a sweep and its points. Pure: it plans nothing and submits nothing (hpcrun.campaign
does), so the planner can use it without an import cycle."""

from __future__ import annotations

import hashlib
import itertools
import json
import typing as tp

from hpcrun.recipe import Sweep

if tp.TYPE_CHECKING:
    from hpcrun.recipe import RecipeFile
    from hpcrun.site import Site


def _matches(point: dict[str, tp.Any], pattern: dict[str, tp.Any]) -> bool:
    return all(key in point and _same(point[key], value) for key, value in pattern.items())


def _same(a: tp.Any, b: tp.Any) -> bool:
    # `strategy: ddp` and `strategy: {name: ddp}` name the same axis value
    norm = lambda v: {"name": v} if isinstance(v, str) else v
    return a == b or norm(a) == norm(b)


def expand(sweep: Sweep) -> list[dict[str, tp.Any]]:
    """Every point as `{dotted field: value}`, in axis order, without duplicates."""
    keys = list(sweep.axes)
    points = [dict(zip(keys, values)) for values in itertools.product(*(sweep.axes[k] for k in keys))]
    points = [p for p in points if not any(_matches(p, ex) for ex in sweep.exclude)]
    for extra in sweep.include:
        if not any(_matches(p, extra) and _matches(extra, p) for p in points):
            points.append(dict(extra))
    return points


def point_id(point: dict[str, tp.Any]) -> str:
    """A short stable id for a point, the same in every invocation (the ledger's key)."""
    blob = json.dumps(point, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def describe(point: dict[str, tp.Any]) -> str:
    parts = []
    for key, value in point.items():
        if isinstance(value, dict):
            value = ",".join(f"{k}={v}" for k, v in value.items())
        parts.append(f"{key}={value}")
    return " ".join(parts)


def sweep_id(recipe_file: RecipeFile, site: Site) -> str:
    """The same recipe on the same site is the same sweep: re-running it continues it."""
    blob = json.dumps(
        {
            "recipe": recipe_file.raw,
            "sweep": recipe_file.sweep.model_dump() if recipe_file.sweep else None,
            "site": site.name,
        },
        sort_keys=True,
        default=str,
    )
    return f"{recipe_file.base.name}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"
