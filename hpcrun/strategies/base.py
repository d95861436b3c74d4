"""What every strategy is: a frozen config that validates itself, says at plan time what a
partition cannot do with it, declares its memory accounting and its results columns, and builds
its engine inside the allocation. Nothing here imports torch: the login side reads these configs.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import pydantic
import pydantic_core

from hpcrun.loader import Frozen

if tp.TYPE_CHECKING:  # only for annotations: runtime imports would cycle or pull torch in
    from hpcrun.runtime.env import DistEnv
    from hpcrun.site import Partition, Site
    from hpcrun.strategies.contract import Engine, OptimizerFactory, Settings


@dataclasses.dataclass(frozen=True)
class Option:
    """A way to lay out model states that the memory planner weighs (ZeRO paper, section 3)."""

    name: str
    recipe: dict[str, object]  # the `strategy:` mapping that asks for it
    shard_params: str  # "none" | "all" | "node"
    shard_grads: bool
    shard_optim: bool
    order: int  # planner preference: less communication and data movement first
    offload: str = "none"  # where optimizer states (and, for ZeRO-3, weights) live: none | cpu | nvme
    stages_checkpoints: bool = True  # an asynchronous save copies the rank's state into host memory first
    # every rank holds the same state (DDP): an in-memory snapshot keeps one copy per node, not per rank
    one_snapshot_per_node: bool = False
    # fp32 weights under autocast (DDP): a 16-bit copy of each weight lives through the step
    casts_weights: bool = False
    # gradients live from backward to zero_grad(set_to_none) only (FSDP), not through the forward
    frees_grads: bool = False
    # the library's own estimator of model-state memory, (host bytes per node, GPU bytes) from
    # (parameters, largest layer, ranks per node, nodes), where it has one
    library_estimate: tp.Callable[[int, int, int, int], tuple[float, float]] | None = dataclasses.field(
        default=None, compare=False
    )


class PlanProblem(ValueError):
    """What a partition or site cannot do with a strategy's setting: `field` is under `strategy.`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Strategy(Frozen):
    """Base of every strategy config; subclasses set `name` to a `Literal` of their name and
    document each field with a docstring below it (it becomes the field's description)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", strict=False, use_attribute_docstrings=True)

    name: str
    """The strategy's registered name, the `name:` key of a recipe's `strategy:` mapping."""

    # plan time (login node) -------------------------------------------------------------
    def check(self, recipe: Settings, partition: Partition, site: Site) -> None:
        """Raise PlanProblem when this setting cannot run on `partition` of `site`."""

    @classmethod
    def planner_options(cls) -> list[Option]:
        """The layouts `hpcrun plan` weighs for this strategy (none: it only plans the recipe's own)."""
        return []

    def memory_option(self) -> Option:
        """The planner's accounting for this very setting."""
        raise NotImplementedError

    def uses_nvme(self) -> bool:
        """Whether the run needs the site's node-local NVMe (and its per-job directory)."""
        return False

    def resumes_at_another_world_size(self) -> bool:
        """Whether an attempt may resume this strategy's state at fewer ranks than saved it (a shrink
        after a lost node: README, "Training on through a lost node"): torch's checkpoints reshard."""
        return True

    def init_on_meta(self) -> bool:
        """Whether the built-in model is created on the meta device and materialised by the engine."""
        return False

    # results ------------------------------------------------------------------------------
    def result_columns(self) -> dict[str, tp.Any]:
        """This strategy's values of the results table's strategy columns."""
        return {"zero_stage": None, "offload_optimizer": "none", "offload_param": "none"}

    # in the allocation (imports torch) ----------------------------------------------------
    def build(
        self,
        model: tp.Any,
        make_optimizer: OptimizerFactory,
        recipe: Settings,
        env: DistEnv,
        run_dir: str | None,
        nvme_dir: str | None,
    ) -> Engine:
        """Wrap `model`, build its optimizer: the engine the training loop drives. `run_dir`
        receives what the engine records of itself; `nvme_dir` is this job's own NVMe directory."""
        raise NotImplementedError


REGISTRY: dict[str, type[Strategy]] = {}

S = tp.TypeVar("S", bound=Strategy)


def register(cls: type[S]) -> type[S]:
    """Make a strategy config class known to recipes under its `name` literal."""
    (name,) = tp.get_args(cls.model_fields["name"].annotation)
    REGISTRY[name] = cls
    return cls


def _from_mapping(value: tp.Any) -> tp.Any:
    """A recipe's `strategy:` mapping as the config class its `name` registers."""
    if isinstance(value, Strategy) or not isinstance(value, dict):
        return value
    name = value.get("name")
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        known = ", ".join(repr(n) for n in REGISTRY)
        raise ValueError(f"must be one of {known} (got {name!r})")
    try:
        return cls.model_validate(value)
    except pydantic.ValidationError as exc:
        unknown = [e for e in exc.errors(include_url=False) if e["type"] == "extra_forbidden"]
        if not unknown:
            raise  # pydantic places these under `strategy.` itself
        # the unknown-key message should list this class's keys: the field's own type knows only `name`
        keys = ", ".join(sorted(cls.model_fields))
        custom = pydantic_core.PydanticCustomError("value_error", "unknown key (valid keys: {keys})", {"keys": keys})
        details: list[pydantic_core.InitErrorDetails] = [
            {"type": custom, "loc": e["loc"], "input": e["input"]} for e in unknown
        ]
        raise pydantic.ValidationError.from_exception_data(exc.title, details) from None


# The type of a recipe's `strategy:` field: any registered config, serialised with its own fields.
StrategyField = tp.Annotated[pydantic.SerializeAsAny[Strategy], pydantic.BeforeValidator(_from_mapping)]
