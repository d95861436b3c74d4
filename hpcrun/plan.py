"""Recipe x Site -> RunSpec: every resource, path and environment variable resolved and checked
against what the site can give, before anything is rendered or submitted."""

from __future__ import annotations

import datetime as dt
import secrets
import typing as tp
from pathlib import Path

import pydantic

from hpcrun.errors import HpcrunError
from hpcrun.fields import format_minutes
from hpcrun.loader import Frozen
from hpcrun.recipe import DDP, FSDP, DeepSpeed, Recipe, RecipeFile
from hpcrun.site import Site
from hpcrun.sweep import expand, point_id


FINAL_WEIGHTS = "final-weights.pt"


class RunSpec(Frozen):
    """One submission: a recipe placed on a site. Written as JSON into the run directory and read
    back by the runtime, so the job runs exactly what was planned."""

    run_id: str
    recipe: Recipe
    recipe_path: str
    site: Site
    partition: str
    nodes: int
    ranks_per_node: int
    gpus_per_node: int
    time_min: int
    signal_lead_s: int
    run_dir: str
    sweep_id: str | None = None
    point_id: str | None = None
    stage: str | None = None
    init_from: str | None = None
    init_weights: str | None = None
    env: dict[str, str] = {}

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def log_folder(self) -> Path:
        """submitit's folder for pickles and per-task logs (`<job>_<task>_log.out`). No `%j` in
        it: SLURM opens `--output` before the job could create a per-job directory."""
        return Path(self.run_dir) / "logs"

    @property
    def nvme_dir(self) -> str | None:
        nvme = self.site.storage.nvme
        return nvme.path if nvme and isinstance(self.recipe.strategy, DeepSpeed) and self.recipe.strategy.uses_nvme else None


def new_run_id(name: str, now: dt.datetime | None = None) -> str:
    """Unique and sortable: UTC time first, a random suffix against same-second collisions."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}-{name}"


def plan(site: Site, recipe: Recipe, recipe_path: str | Path, run_id: str, **ids: tp.Any) -> RunSpec:
    """Check `recipe` against `site` and resolve it; errors name the recipe file and field."""
    res = recipe.resources
    where = str(recipe_path)
    part_name = res.partition or site.default_partition
    if part_name not in site.partitions:
        raise HpcrunError(
            f"site {site.name!r} has no partition {part_name!r} (it has: {', '.join(site.partitions)})", where, "resources.partition"
        )
    part = site.partitions[part_name]
    if res.nodes > part.max_nodes:
        raise HpcrunError(f"must be <= {part.max_nodes}, the most partition {part_name!r} allows (got {res.nodes})", where, "resources.nodes")
    kind = "GPUs" if part.gpus_per_node else "CPUs (one process per rank)"
    if res.gpus_per_node > part.max_ranks_per_node:
        raise HpcrunError(
            f"must be <= {part.max_ranks_per_node}, the {kind} per node of partition {part_name!r} (got {res.gpus_per_node})",
            where,
            "resources.gpus_per_node",
        )
    if res.time > part.max_time:
        raise HpcrunError(
            f"must be <= {format_minutes(part.max_time)}, the time limit of partition {part_name!r} (got {format_minutes(res.time)})",
            where,
            "resources.time",
        )
    strategy = recipe.strategy
    if isinstance(strategy, DeepSpeed) and strategy.uses_nvme and site.storage.nvme is None:
        field = "strategy.offload_param" if strategy.offload_param == "nvme" else "strategy.offload_optimizer"
        raise HpcrunError(f"nvme offload needs storage.nvme in site {site.name!r}, which has none", where, field)
    if not part.gpus_per_node:  # what gloo on CPU cannot do, said before anything is submitted
        if recipe.precision == "fp16-mixed":
            raise HpcrunError("fp16-mixed needs GPUs; use fp32 or bf16-mixed on a CPU partition", where, "precision")
        if isinstance(strategy, DDP) and strategy.comm_hook == "bf16":
            raise HpcrunError("the bf16 compression hook needs NCCL (GPUs); use fp16 or powersgd on a CPU partition", where, "strategy.comm_hook")
        if isinstance(strategy, FSDP) and strategy.cpu_offload:
            raise HpcrunError("FSDP CPU offload moves parameters off a GPU; this partition has none", where, "strategy.cpu_offload")
    env = {**site.interconnect_env(), **recipe.env}
    lead = recipe.checkpoint.signal_lead_s or site.signal_lead_s
    try:
        return RunSpec(
            run_id=run_id,
            recipe=recipe,
            recipe_path=where,
            site=site,
            partition=part_name,
            nodes=res.nodes,
            ranks_per_node=res.gpus_per_node,
            gpus_per_node=res.gpus_per_node if part.gpus_per_node else 0,
            time_min=res.time,
            signal_lead_s=min(lead, max(10, res.time * 60 // 2)),
            run_dir=str(Path(site.storage.runs_dir) / run_id),
            env=env,
            **ids,
        )
    except pydantic.ValidationError as exc:  # only ids can be wrong here; they come from code
        raise HpcrunError(str(exc).splitlines()[0], where) from exc


def plan_point(site: Site, recipe_file: RecipeFile, sweep_id: str, overrides: dict[str, tp.Any]) -> RunSpec:
    """One sweep point as a run of its own, `<sweep id>.<point id>`."""
    pid = point_id(overrides)
    return plan(site, recipe_file.point(overrides), recipe_file.path, f"{sweep_id}.{pid}", sweep_id=sweep_id, point_id=pid)


def runs_of(site: Site, recipe_file: RecipeFile, run_id: str) -> list[RunSpec]:
    """Every run a recipe file asks for on `site`: one per stage, one per sweep point, or one.
    Each is checked against the site, so a bad stage or point fails before anything is sent."""
    where = recipe_file.path
    if recipe_file.stages:
        specs: list[RunSpec] = []
        last = len(recipe_file.stages) - 1
        for i, (stage, recipe) in enumerate(recipe_file.stages):
            if i < last:  # its successor starts from these weights, whatever its strategy
                recipe = recipe.model_copy(update={"checkpoint": recipe.checkpoint.model_copy(update={"export_final": True})})
            weights = str(Path(specs[-1].run_dir) / FINAL_WEIGHTS) if specs and stage.init_from == "previous" else None
            specs.append(plan(site, recipe, where, f"{run_id}.{stage.name}", stage=stage.name, init_from=stage.init_from, init_weights=weights))
        return specs
    if recipe_file.sweep:  # the first point that cannot run fails (`hpcrun sweep` skips it instead)
        return [plan_point(site, recipe_file, run_id, point) for point in expand(recipe_file.sweep)]
    return [plan(site, recipe_file.base, where, run_id)]
