"""Recipe x Site -> RunSpec: every resource, path and environment variable resolved and checked
against what the site can give, before anything is rendered or submitted."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
import typing as tp
from pathlib import Path

import pydantic

from hpcrun.cadence import Policy
from hpcrun.errors import HpcrunError
from hpcrun.fields import format_minutes
from hpcrun.loader import Frozen
from hpcrun.provenance import git_sha
from hpcrun.recipe import BenchmarkJob, Recipe, RecipeFile
from hpcrun.rundir import RunDir
from hpcrun.site import NVMe, Partition, Site
from hpcrun.sizes import SIZES, GPTSize
from hpcrun.strategies import PlanProblem, Strategy
from hpcrun.sweep import expand, point_id


class RunSpec(Frozen):
    """One submission: a recipe placed on a site, every decided value resolved. Written as JSON
    into the run directory and read back by the runtime, which reads nothing else: no site
    lookups, no re-derived peaks, no values passed through the environment."""

    run_id: str
    recipe: Recipe
    recipe_path: str
    site: Site  # what the login side renders from; the runtime reads the resolved fields below
    partition: str
    partition_spec: Partition
    """The partition itself, as the site declares it."""
    gpu_model: str
    """The partition's accelerator model, `cpu` on a CPU partition (a results column)."""
    peak_tflops: float | None
    """What MFU divides by: one rank's peak TFLOP/s at the recipe's precision on this partition
    (the GPU's dense fp16/bf16 peak, or the site's per-rank CPU figure; None when unknown)."""
    scheduler: tp.Literal["slurm", "local"]
    site_name: str
    cluster: str
    interconnect: str
    site_hash: str
    """A digest of the site profile the run was planned on (results provenance)."""
    git_sha: str | None = None
    """The commit of the user's code (the recipe's directory) when planned; None for the built-in
    benchmark, outside a git checkout, and in runs planned before hpcrun recorded it here."""
    nodes: int
    ranks_per_node: int
    gpus_per_node: int
    time_min: int
    signal_lead_s: int
    run_dir: str
    results_dir: str
    nvme: NVMe | None
    """The site's node-local NVMe, whatever the strategy (the planner weighs ZeRO-Infinity on it)."""
    nvme_dir: str | None
    """The NVMe base directory when the strategy swaps to it; each job uses its own directory
    below it, `hpcrun.rundir.nvme_job_dir(nvme_dir, allocation id)`."""
    local_scratch: str = "/dev/shm"
    """The node-local directory in-memory snapshots go to (the site's `storage.local_scratch`)."""
    model: str | None
    """The built-in benchmark's model size name, None for user jobs."""
    size: GPTSize | None
    sweep_id: str | None = None
    point_id: str | None = None
    stage: str | None = None
    init_from: str | None = None
    init_weights: str | None = None
    env: dict[str, str] = {}
    node_mtbf_hours: float | None = None
    """A node's MTBF learned from the site's results on this partition (hpcrun.mtbf), set where the
    spec is submitted or shown (`plan` itself reads no files); None: the partition's `node_mtbf_hours`."""
    mtbf_source: str = "the site's node_mtbf_hours"
    """Where the node MTBF came from, in words (`hpcrun plan`)."""

    @property
    def strategy(self) -> Strategy:
        return self.recipe.strategy

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def takes_snapshots(self) -> bool:
        """Whether the ranks keep in-memory snapshots (hpcrun.runtime.snapshot): only a restart
        inside the job reads them, so on a local site (none there) only where the recipe sets
        `memory_interval` (the cost benchmark, tests); a command job's ranks are not hpcrun's.
        DeepSpeed's engine keeps none (its ranks say so and use disk only)."""
        recipe = self.recipe
        asked = self.scheduler == "slurm" or "memory_interval" in recipe.checkpoint.model_fields_set
        return bool(asked and recipe.checkpoint.memory_interval != 0 and recipe.fault.restarts_in_job
                    and recipe.job.kind != "command")

    @property
    def mtbf_s(self) -> float:
        """The job's expected time between failures: the recipe's, else its nodes' together (a failure
        of any node stops the job), each node's as learned (`node_mtbf_hours`) or the site's."""
        node = self.node_mtbf_hours or self.partition_spec.node_mtbf_hours
        return (self.recipe.fault.mtbf_hours or node / self.allocated_nodes) * 3600

    def mtbf_said(self) -> str:
        """The MTBF the saves are spaced by and where it came from, in one line (`hpcrun plan`)."""
        if self.recipe.fault.mtbf_hours:
            return f"MTBF {self.recipe.fault.mtbf_hours:.1f} h: the recipe's fault.mtbf_hours"
        node = self.node_mtbf_hours or self.partition_spec.node_mtbf_hours
        nodes = self.allocated_nodes
        held = f"{nodes} nodes ({node:.1f} h per node)" if nodes > 1 else "1 node"
        return f"MTBF {self.mtbf_s / 3600:.1f} h for {held}: {self.mtbf_source}"

    def cadence(self, kind: tp.Literal["checkpoint", "snapshot"]) -> Policy:
        """How this run spaces its disk checkpoints or its in-memory snapshots (hpcrun.cadence)."""
        ckpt = self.recipe.checkpoint
        steps, max_min = (ckpt.interval, ckpt.max_minutes) if kind == "checkpoint" else (
            ckpt.memory_interval, ckpt.memory_max_minutes)
        return Policy(kind, steps, ckpt.overhead, self.mtbf_s, max_min * 60)

    @property
    def min_nodes(self) -> int:
        """The fewest nodes the job trains on after losing some with no spare left (`fault.min_nodes`,
        resolved: README, "Training on through a lost node"); `nodes`: it never shrinks."""
        job, asked = self.recipe.job, self.recipe.fault.min_nodes
        if job.kind in ("command", "function") or not self.strategy.resumes_at_another_world_size():
            return self.nodes
        if asked is not None:
            return asked
        return -(-self.nodes // 2) if job.kind == "benchmark" else self.nodes

    @property
    def shrinks(self) -> bool:
        """Whether a lost node with no spare left may leave the job training on fewer nodes."""
        return self.scheduler == "slurm" and bool(self.recipe.fault.restarts_in_job) and self.min_nodes < self.nodes

    @property
    def outlives_lost_nodes(self) -> bool:
        """Whether the job asks SLURM to keep it through a lost node (`--no-kill`): with spares, or where
        its training step restarts inside the allocation on several nodes (then hpcrun's failure step
        decides: a spare, a shrink, or a requeue of its own). Not by strategy: a sweep's points of one
        shape share one array script."""
        kind = self.recipe.job.kind
        in_job = self.scheduler == "slurm" and bool(self.recipe.fault.restarts_in_job)
        return bool(self.spare_nodes) or (in_job and self.nodes > 1 and kind in ("benchmark", "entrypoint"))

    @property
    def spare_nodes(self) -> int:
        return self.recipe.resources.spare_nodes

    @property
    def allocated_nodes(self) -> int:
        """What the job holds: the training nodes and the hot spares."""
        return self.nodes + self.spare_nodes

    @property
    def launcher(self) -> str:
        job = self.recipe.job
        return job.launcher if job.kind == "command" else "srun"

    @property
    def tasks_per_node(self) -> int:
        """Tasks SLURM starts per node: one per rank, or one torchrun per node."""
        return 1 if self.launcher == "torchrun" else self.ranks_per_node

    @property
    def cpus_per_task(self) -> int | None:
        """A torchrun task holds its node's ranks' CPUs (one each unless the recipe says more):
        under task/cgroup a task can use only the CPUs it was given."""
        per_rank = self.recipe.resources.cpus_per_task
        if self.launcher == "torchrun":
            return self.ranks_per_node * (per_rank or 1)
        return per_rank

    @property
    def log_folder(self) -> Path:
        """Per-task logs (`<job>_<task>_log.out`). No `%j` in the folder: SLURM opens `--output`
        before the job could create a per-job directory."""
        return RunDir(self.run_dir).logs


def peak_tflops(part: Partition, precision: str) -> float | None:
    """One rank's peak at `precision`: fp16 where the GPU lists it, its bf16 peak otherwise
    (fp32 training is measured against the tensor-core peak too, as MFU usually is)."""
    if part.gpu:
        return part.gpu.peak_fp16 if precision == "fp16-mixed" else part.gpu.peak_tflops_bf16
    return part.cpu_peak_tflops_per_rank


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
            f"site {site.name!r} has no partition {part_name!r} (it has: {', '.join(site.partitions)})",
            where,
            "resources.partition",
        )
    part = site.partitions[part_name]
    if res.spare_nodes and site.scheduler != "slurm":
        raise HpcrunError("spare nodes need a SLURM site (a local run has one machine)", where, "resources.spare_nodes")
    if res.nodes + res.spare_nodes > part.max_nodes:
        spares = f" + {res.spare_nodes} spare" if res.spare_nodes else ""
        raise HpcrunError(
            f"must be <= {part.max_nodes}, the most partition {part_name!r} allows (got {res.nodes}{spares})",
            where,
            "resources.spare_nodes" if res.spare_nodes and res.nodes <= part.max_nodes else "resources.nodes",
        )
    least = recipe.fault.min_nodes
    if least is not None and least > res.nodes:
        raise HpcrunError(f"must be <= resources.nodes ({res.nodes})", where, "fault.min_nodes")
    if least is not None and least < res.nodes:
        if not recipe.fault.restarts_in_job:
            raise HpcrunError("a job shrinks only when it restarts inside its allocation: set fault.restarts_in_job",
                              where, "fault.min_nodes")
        if recipe.job.kind in ("command", "function"):
            raise HpcrunError(f"a {recipe.job.kind} job's own code holds its ranks: it cannot train on fewer nodes",
                              where, "fault.min_nodes")
        if not recipe.strategy.resumes_at_another_world_size():
            raise HpcrunError(f"strategy {recipe.strategy.name} resumes only at the world size that saved it",
                              where, "fault.min_nodes")
    if res.spare_nodes and not recipe.fault.restarts_in_job:
        raise HpcrunError("spare nodes are used only by restarts inside the job: set fault.restarts_in_job",
                          where, "resources.spare_nodes")
    kind = "GPUs" if part.gpus_per_node else "CPUs (one process per rank)"
    if res.gpus_per_node > part.max_ranks_per_node:
        raise HpcrunError(
            f"must be <= {part.max_ranks_per_node}, the {kind} per node of partition {part_name!r} "
            f"(got {res.gpus_per_node})",
            where,
            "resources.gpus_per_node",
        )
    if res.time > part.max_time:
        raise HpcrunError(
            f"must be <= {format_minutes(part.max_time)}, the time limit of partition {part_name!r} "
            f"(got {format_minutes(res.time)})",
            where,
            "resources.time",
        )
    if res.mem_gb is not None:
        if res.mem_gb > part.memory_gb:
            raise HpcrunError(f"must be <= {part.memory_gb:g}, the memory per node of partition {part_name!r} "
                              f"(got {res.mem_gb:g})", where, "resources.mem_gb")
        asked = next((o for o in site.environment.sbatch if o.startswith("--mem")), None)
        if asked:
            raise HpcrunError(f"the site profile asks for memory already ({asked} in environment.sbatch)",
                              where, "resources.mem_gb")
    strategy = recipe.strategy
    try:  # what the strategy cannot do here (gloo on CPU, no NVMe), said before anything is submitted
        strategy.check(recipe, part, site)
    except PlanProblem as exc:
        raise HpcrunError(str(exc), where, f"strategy.{exc.field}") from None
    if not part.gpus_per_node and recipe.precision == "fp16-mixed":
        raise HpcrunError("fp16-mixed needs GPUs; use fp32 or bf16-mixed on a CPU partition", where, "precision")
    job = recipe.job
    model = job.model if isinstance(job, BenchmarkJob) else None
    env = {**site.interconnect_env(), **recipe.env}
    lead = recipe.checkpoint.signal_lead_s or site.signal_lead_s
    try:
        return RunSpec(
            run_id=run_id,
            recipe=recipe,
            recipe_path=where,
            site=site,
            partition=part_name,
            partition_spec=part,
            gpu_model=part.gpu.model if part.gpu else "cpu",
            peak_tflops=peak_tflops(part, recipe.precision),
            scheduler=site.scheduler,
            site_name=site.name,
            cluster=site.cluster or site.name,
            interconnect=site.network.interconnect,
            site_hash=hashlib.sha256(site.model_dump_json().encode()).hexdigest()[:16],
            git_sha=None if isinstance(job, BenchmarkJob) else git_sha(where),
            nodes=res.nodes,
            ranks_per_node=res.gpus_per_node,
            gpus_per_node=res.gpus_per_node if part.gpus_per_node else 0,
            time_min=res.time,
            signal_lead_s=min(lead, max(10, res.time * 60 // 2)),
            run_dir=str(Path(site.storage.runs_dir) / run_id),
            results_dir=str(site.results_dir),
            nvme=site.storage.nvme,
            nvme_dir=site.storage.nvme.path if site.storage.nvme and strategy.uses_nvme() else None,
            local_scratch=site.storage.local_scratch or "/dev/shm",
            model=model,
            size=SIZES[model] if model else None,
            env=env,
            **ids,
        )
    except pydantic.ValidationError as exc:  # only ids can be wrong here; they come from code
        raise HpcrunError(str(exc).splitlines()[0], where) from exc


def plan_point(site: Site, recipe_file: RecipeFile, sweep_id: str, overrides: dict[str, tp.Any]) -> RunSpec:
    """One sweep point as a run of its own, `<sweep id>.<point id>`."""
    pid = point_id(overrides)
    return plan(
        site, recipe_file.point(overrides), recipe_file.path, f"{sweep_id}.{pid}", sweep_id=sweep_id, point_id=pid
    )


def runs_of(site: Site, recipe_file: RecipeFile, run_id: str) -> list[RunSpec]:
    """Every run a recipe file asks for on `site`: one per stage, one per sweep point, or one.
    Each is checked against the site, so a bad stage or point fails before anything is sent."""
    where = recipe_file.path
    if recipe_file.stages:
        specs: list[RunSpec] = []
        last = len(recipe_file.stages) - 1
        for i, (stage, recipe) in enumerate(recipe_file.stages):
            if i < last:  # its successor starts from these weights, whatever its strategy
                recipe = recipe.model_copy(
                    update={"checkpoint": recipe.checkpoint.model_copy(update={"export_final": True})}
                )
            weights = str(RunDir(specs[-1].run_dir).final_weights) if specs and stage.init_from == "previous" else None
            specs.append(
                plan(
                    site,
                    recipe,
                    where,
                    f"{run_id}.{stage.name}",
                    stage=stage.name,
                    init_from=stage.init_from,
                    init_weights=weights,
                )
            )
        return specs
    if recipe_file.sweep:  # the first point that cannot run fails (`hpcrun sweep` skips it instead)
        return [plan_point(site, recipe_file, run_id, point) for point in expand(recipe_file.sweep)]
    return [plan(site, recipe_file.base, where, run_id)]
