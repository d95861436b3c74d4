"""Recipes: what to run (job, resources, strategy, precision, training, checkpoint, stages, sweep)."""

from __future__ import annotations

import copy
import importlib.util
import typing as tp
from pathlib import Path

import pydantic

from hpcrun.errors import HpcrunError
from hpcrun.fields import EnvName, Line, Minutes, Name, PathStr, Token
from hpcrun.loader import Frozen, error_from, read_yaml, validate
from hpcrun.sizes import SIZES
from hpcrun.strategies import DDP, StrategyField

Precision = tp.Literal["fp32", "bf16-mixed", "fp16-mixed"]


class BenchmarkJob(Frozen):
    """The built-in GPT benchmark on synthetic tokens."""

    kind: tp.Literal["benchmark"]
    model: str = "tiny"

    @pydantic.field_validator("model")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in SIZES:
            raise ValueError(f"unknown model size {value!r}; known: {', '.join(SIZES)}")
        return value


class EntrypointJob(Frozen):
    """A user's Python function `module:function`, handed a context object."""

    kind: tp.Literal["entrypoint"]
    entrypoint: str = pydantic.Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    args: dict[str, tp.Any] = {}
    pythonpath: list[PathStr] = []


class CommandJob(Frozen):
    """A user's existing training command. `launcher: srun` starts it once per rank with the
    distributed environment set (a Lightning script sees a consistent SLURM allocation);
    `launcher: torchrun` starts torchrun once per node, which starts the ranks (c10d rendezvous
    on the first node). The same `command` serves both: torchrun runs it as given."""

    kind: tp.Literal["command"]
    command: list[Line] = pydantic.Field(min_length=1)
    workdir: PathStr | None = None
    launcher: tp.Literal["srun", "torchrun"] = "srun"


class FunctionJob(Frozen):
    """A pickled Python call submitted through hpcrun's submitit executor (hpcrun.executor), which
    writes this job itself: the call is the run directory's function pickle, and each task's
    result pickle goes where submitit's Job reads it."""

    kind: tp.Literal["function"]
    folder: PathStr | None = None
    """The submitit folder of the job's results and logs (an array's shared log folder); None:
    the run's own logs/."""


Job = tp.Annotated[BenchmarkJob | EntrypointJob | CommandJob | FunctionJob, pydantic.Field(discriminator="kind")]


class Resources(Frozen):
    """How much of the cluster. `gpus_per_node` is ranks per node: one per GPU, or one CPU
    process per rank on a CPU partition."""

    nodes: int = pydantic.Field(default=1, ge=1)
    gpus_per_node: int = pydantic.Field(default=1, ge=1)
    partition: Token | None = None
    time: Minutes = 60
    cpus_per_task: int | None = pydantic.Field(default=None, ge=1)
    mem_gb: float | None = pydantic.Field(default=None, gt=0)
    """Memory per node to ask SLURM for (`#SBATCH --mem`), at most the partition's `memory_gb`.
    None: none asked for, the partition's default."""
    spare_nodes: int = pydantic.Field(default=0, ge=0, le=16)
    """Hot spares: the job holds `nodes + spare_nodes` nodes and trains on `nodes`; a node lost (or
    excluded as slow) is replaced by a spare at the next restart inside the job (fault.restarts_in_job)."""


class Training(Frozen):
    steps: int = pydantic.Field(default=20, ge=1)
    micro_batch: int = pydantic.Field(default=4, ge=1)
    grad_accum: int = pydantic.Field(default=1, ge=1)
    seq_len: int = pydantic.Field(default=64, ge=8)
    seed: int = pydantic.Field(default=0, ge=0)
    lr: float = pydantic.Field(default=1e-3, gt=0)
    grad_clip: float | None = pydantic.Field(default=1.0, gt=0)
    activation_checkpointing: bool = False
    warmup_steps: int = pydantic.Field(default=2, ge=0)
    log_interval: int = pydantic.Field(default=10, ge=1)
    compile: bool = False
    """The built-in benchmark's blocks through torch.compile (fused LayerNorm, GELU and residual
    adds on a GPU). Off by default: it costs start-up time, and changes the numbers of the eager
    runs a comparison or an exact resume is made against."""


class Checkpoint(Frozen):
    """Disk checkpoints (durable: requeues and new jobs resume from them) and in-memory snapshots
    (a restart inside the job resumes from them). Both are spaced by time unless the recipe gives
    a step count: from their measured cost, the job's expected time between failures
    (`fault.mtbf_hours`) and `overhead` (hpcrun.cadence; `hpcrun plan` and `status` say what was chosen)."""

    interval: int | None = pydantic.Field(default=None, ge=1)
    """Every how many steps to write a disk checkpoint. None: by time (hpcrun.cadence), at most
    `max_minutes` apart. The last step and a stop for a signal are always saved."""
    keep: int = 2
    max_requeues: int = pydantic.Field(default=3, ge=0, le=4)
    max_timeouts: int | None = pydantic.Field(default=None, ge=0)
    """How many of a job's requeues may follow a stop at its time limit (submitit's `max_num_timeout`):
    a stop whose signal came within the signal lead of the job's time limit (and 90 s: SLURM's
    resolution and the job's start) counts, a preemption does not. None: not counted apart
    (`max_requeues` bounds every requeue, timeouts included, as it does in any case)."""
    signal_lead_s: int | None = pydantic.Field(default=None, ge=10)
    export_final: bool = False  # write final-weights.pt (full fp32, any strategy can load it) and its sha256
    # DDP/FSDP: write in the background; training stalls only for a copy of the rank's state into
    # host buffers (as much host memory again, for the run); DeepSpeed always writes synchronously
    asynchronous: bool = True
    memory_interval: int | None = pydantic.Field(default=None, ge=0)
    """Every how many steps each rank snapshots its whole training state into node-local memory
    (the site's `storage.local_scratch`) and copies it to a rank on another node, for a restart
    inside the job (hpcrun.runtime.snapshot); requeues and new jobs resume from disk. None: by
    time (hpcrun.cadence), at most `memory_max_minutes` apart; 0: off. A snapshot due while the
    previous one is still being written or sent is skipped, never waited for. DDP and FSDP;
    DeepSpeed saves to disk only."""
    overhead: float = pydantic.Field(default=0.01, gt=0, le=0.5)
    """The most of the wall time disk checkpoints may take, and in-memory snapshots apart: each is
    spaced at least its measured cost divided by this (the stall and the slower steps beside it)."""
    max_minutes: float = pydantic.Field(default=30.0, gt=0)
    """The longest time between disk checkpoints spaced by time, when their cost allows it."""
    memory_max_minutes: float = pydantic.Field(default=5.0, gt=0)
    """The longest time between in-memory snapshots spaced by time, when their cost allows it."""

    @pydantic.field_validator("keep")
    @classmethod
    def _keep(cls, value: int) -> int:
        if value < 2:
            raise ValueError(f"keep at least 2 checkpoints: the last one may still be being written (got {value})")
        return value

    @pydantic.field_validator("max_timeouts")
    @classmethod
    def _within_requeues(cls, value: int | None, info: pydantic.ValidationInfo) -> int | None:
        cap = info.data.get("max_requeues")
        if value is not None and cap is not None and value > cap:
            raise ValueError(f"must be <= checkpoint.max_requeues ({cap}), which bounds every requeue, "
                             f"timeouts included (got {value})")
        return value


class Metrics(Frozen):
    """Per-step metrics (hpcrun.steps): rank 0 writes a batch every `flush_steps` steps or
    `flush_seconds` seconds, whichever comes first, and at every checkpoint and stop."""

    flush_steps: int = pydantic.Field(default=1000, ge=1)
    """At most this many steps between flushes. Each flush costs every rank a gather and rank 0's
    writer some CPU: at 20 ms steps on CPU ranks, 100-step flushes took ~3% of the training."""
    flush_seconds: float = pydantic.Field(default=30.0, gt=0)
    """At most this long between flushes: `hpcrun status` and the steps table lag by no more."""
    tensorboard: bool = False
    """Also write TensorBoard event files into the run directory (`pip install hpcrun[tensorboard]`)."""
    per_rank_interval: int = pydantic.Field(default=1, ge=0)
    """Every how many steps the spread of step times across ranks is recorded (0: never)."""

    @pydantic.field_validator("tensorboard")
    @classmethod
    def _installed(cls, value: bool) -> bool:
        if value and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("needs the tensorboard package: pip install 'hpcrun[tensorboard]'")
        return value


class Fault(Frozen):
    """How an attempt that fails without a polite signal is noticed, named and routed around."""

    collective_timeout_s: int = pydantic.Field(default=300, ge=10)
    """How long a collective may wait for a peer before the attempt fails (a dead peer must end
    the job, not hold the allocation); PyTorch's own default is 600 s."""
    hang_timeout_s: int | None = pydantic.Field(default=None, ge=10)
    """A rank that makes no step progress this long is hung: stacks are dumped and the attempt
    ends. None: derived from the job's own steps, 5 times the slowest of the last 100 (at least
    120 s), and not counted while the training thread keeps a core busy, for up to 10 minutes
    (hpcrun.runtime.watchdog)."""
    peer_timeout_s: float | None = pydantic.Field(default=5.0, ge=1)
    """A rank whose pulse (a datagram its watchdog thread sends the next rank twice a second) stops
    this long has stopped, died or lost its node: the next rank ends the attempt, naming it
    (hpcrun.runtime.pulse). None: no pulse ring (a network that drops UDP between nodes)."""
    restarts_in_job: int = pydantic.Field(default=5, ge=0, le=20)
    """On SLURM, how many times a failed training step (a dead, hung or lost rank) is started again
    inside the same allocation, from the newest complete state, before the job falls back to a
    requeue. 0: every failure requeues (through the queue). Stops for a signal always requeue. A
    restart costs seconds; a long job meets several faults, and the same-crash rule, not this cap,
    is what stops a crash loop (`checkpoint.max_requeues` still bounds the run)."""
    warm_standby: bool = True
    """On SLURM with restarts in the job, the next attempt's ranks wait beside this one's on its nodes,
    Python and torch imported once it trains, and become the restart on the same nodes (a dead or
    hung rank) without starting processes (hpcrun.runtime.standby). Costs each rank's idle
    interpreter in host memory (~0.3-0.5 GB with torch); off: every restart starts its ranks anew."""
    min_nodes: int | None = pydantic.Field(default=None, ge=1)
    """A job that loses a node with no spare left trains on inside its allocation on the nodes it
    still has, down to this many, with the same global batch: the ranks left take the lost ranks'
    share of every step by gradient accumulation (README, "Training on through a lost node"); below
    it the job is requeued. None: half its nodes, rounded up, for the built-in benchmark; its
    `nodes` (no shrink) for an entrypoint job, whose own data loading must take its share from
    `ctx.data_ranks` first (and run `ctx.padding` micro-steps of weight 0). Command and function jobs,
    DeepSpeed's stage 0 and ZeRO-Infinity on NVMe, never shrink."""
    mtbf_hours: float | None = pydantic.Field(default=None, gt=0)
    """The job's expected time between failures, which spaces checkpoints and snapshots
    (hpcrun.cadence). None: the partition's `node_mtbf_hours` divided by the job's nodes."""
    exclude_failed_nodes: bool = True
    """A requeued job avoids nodes that failed during this run, while the partition has enough."""
    straggler_factor: float | None = pydantic.Field(default=2.0, gt=1)
    """A rank whose fixed local work takes more than this many times the other ranks' median, at
    three quarters of its latest metrics flushes (at least 3, spanning at least 10 s), is named
    slow with its node (status, results `slow_ranks`). None: no check."""
    straggler_probe_share: float = pydantic.Field(default=0.005, gt=0, le=1)
    """The most of the ranks' time the slow-rank check's probe may take: probes come at most this
    often (and never more than every 2.5 s): ~every 8 s at a CPU rank's 40 ms probe, 2.5 s on a GPU."""
    exclude_slow_nodes: bool = False
    """A requeued job also avoids the nodes of ranks named slow, while the partition has enough."""


class Recipe(Frozen):
    """One runnable recipe (a stage or a sweep point is also one)."""

    name: Name
    job: Job = BenchmarkJob(kind="benchmark")
    resources: Resources = Resources()
    strategy: StrategyField = DDP(name="ddp")
    """How ranks share the model: any registered strategy (hpcrun.strategies), by its `name`."""
    precision: Precision = "fp32"
    training: Training = Training()
    checkpoint: Checkpoint = Checkpoint()
    metrics: Metrics = Metrics()
    fault: Fault = Fault()
    env: dict[EnvName, Line] = {}


class Stage(Frozen):
    """A step of a multi-stage recipe; its fields override the recipe's for that stage."""

    name: Name
    dependency: tp.Literal["afterok", "afterany", "afternotok"] = "afterok"
    init_from: tp.Literal["previous", "none"] = "previous"
    resources: dict[str, tp.Any] = {}
    strategy: dict[str, tp.Any] | None = None
    precision: Precision | None = None
    training: dict[str, tp.Any] = {}
    checkpoint: dict[str, tp.Any] = {}
    metrics: dict[str, tp.Any] = {}
    fault: dict[str, tp.Any] = {}


class Sweep(Frozen):
    """A matrix over dotted recipe fields (`strategy`, `resources.nodes`, `training.micro_batch`)."""

    axes: dict[str, list[tp.Any]] = pydantic.Field(min_length=1)
    include: list[dict[str, tp.Any]] = []
    exclude: list[dict[str, tp.Any]] = []
    max_concurrent: int | None = pydantic.Field(default=None, ge=1)

    @pydantic.field_validator("axes")
    @classmethod
    def _axes(cls, value: dict[str, list[tp.Any]]) -> dict[str, list[tp.Any]]:
        for key, values in value.items():
            if key.split(".")[0] not in SWEEPABLE:
                raise ValueError(f"axis {key!r} must start with one of {', '.join(SWEEPABLE)}")
            if not values:
                raise ValueError(f"axis {key!r} has no values")
        return value


SWEEPABLE = ("job", "resources", "strategy", "precision", "training", "checkpoint", "metrics", "fault")
STAGE_MERGED = ("resources", "training", "checkpoint", "metrics", "fault")


class RecipeFile(Frozen):
    """A recipe file after validation: the base recipe, its stages and its sweep, each checked."""

    path: str
    base: Recipe
    stages: list[tuple[Stage, Recipe]] = []
    sweep: Sweep | None = None
    raw: dict[str, tp.Any] = pydantic.Field(default={}, exclude=True)

    def point(self, overrides: dict[str, tp.Any]) -> Recipe:
        """The recipe with dotted-path `overrides` applied (a sweep point), validated."""
        data = apply_overrides(self.raw, overrides)
        try:
            return Recipe.model_validate(data)
        except pydantic.ValidationError as exc:
            raise error_from(exc, data, Recipe, self.path) from exc


def apply_overrides(base: dict[str, tp.Any], overrides: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """A deep copy of `base` with each dotted key of `overrides` set. A string value for
    `strategy` is shorthand for `{name: value}`."""
    data = copy.deepcopy(base)
    for dotted, value in overrides.items():
        keys = dotted.split(".")
        node = data
        for key in keys[:-1]:
            child = node.get(key)
            node[key] = child = dict(child) if isinstance(child, dict) else {}
            node = child
        if keys == ["strategy"] and isinstance(value, str):
            value = {"name": value}
        node[keys[-1]] = copy.deepcopy(value)
    return data


def _stage_data(base: dict[str, tp.Any], stage: dict[str, tp.Any]) -> dict[str, tp.Any]:
    data = copy.deepcopy(base)
    data.pop("stages", None)
    data.pop("sweep", None)
    data["name"] = f"{base.get('name')}.{stage.get('name')}"
    for key in STAGE_MERGED:
        if stage.get(key):
            data[key] = {**(data.get(key) or {}), **stage[key]}
    for key in ("strategy", "precision"):
        if stage.get(key) is not None:
            data[key] = stage[key]
    return data


def load_recipe(path: str | Path) -> RecipeFile:
    """Read and validate a recipe file: the base, every stage and the sweep's shape."""
    return parse_recipe(read_yaml(Path(path)), Path(path))


def parse_recipe(raw: dict[str, tp.Any], path: Path) -> RecipeFile:
    """Validate a recipe's data as if read from `path`: errors name it, and the recipe's relative
    paths (job.pythonpath) are relative to its directory."""
    if not isinstance(raw, dict):
        raise HpcrunError(f"must be a mapping of recipe fields (got {type(raw).__name__})", path)
    base_data = {k: v for k, v in raw.items() if k not in ("stages", "sweep")}
    base = validate(Recipe, base_data, path)
    stages: list[tuple[Stage, Recipe]] = []
    raw_stages = raw.get("stages") or []
    if not isinstance(raw_stages, list):
        raise HpcrunError(f"must be a list of stages (got {type(raw_stages).__name__})", path, "stages")
    names: set[str] = set()
    for i, item in enumerate(raw_stages):
        stage = validate(Stage, item, path, f"stages.{i}")
        if stage.name in names:
            raise HpcrunError(f"duplicate stage name {stage.name!r}", path, f"stages.{i}.name")
        names.add(stage.name)
        merged = _stage_data(base_data, item)
        stages.append((stage, validate(Recipe, merged, path, f"stages.{i}")))
    sweep = None
    if raw.get("sweep") is not None:
        sweep = validate(Sweep, raw["sweep"], path, "sweep")
        if stages:
            raise HpcrunError("a recipe has either stages or a sweep, not both", path, "sweep")
    return RecipeFile(path=str(path), base=base, stages=stages, sweep=sweep, raw=base_data)

