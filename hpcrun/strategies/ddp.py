"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

import typing as tp

import pydantic

from hpcrun.strategies.base import Option, PlanProblem, Strategy

if tp.TYPE_CHECKING:
    from hpcrun.runtime.env import DistEnv
    from hpcrun.site import Partition, Site
    from hpcrun.strategies.contract import Engine, OptimizerFactory, Settings

REPLICATED = Option(
    "ddp", {"name": "ddp"}, "none", False, False, order=0, one_snapshot_per_node=True, casts_weights=True
)


class DDP(Strategy):
    name: tp.Literal["ddp"]
    static_graph: bool = False
    """Tell DDP the graph is the same every step (lets it skip per-step bookkeeping)."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into the all-reduce buckets: one copy of the gradients fewer."""
    find_unused_parameters: bool = False
    """Search the graph for parameters without gradients each step (only models that skip some need it)."""
    comm_hook: tp.Literal["none", "bf16", "fp16", "powersgd"] = "none"
    """How gradients are all-reduced. `none` (default): DDP's own bucketed all-reduce, laid out
    the same way in every attempt (hpcrun.runtime.engine `TorchEngine.settle_buckets`), so a
    resumed run ends with the same weights bit for bit. `bf16`/`fp16`/`powersgd` compress the
    gradients (bf16 needs NCCL, GPUs); not bit-exact across a resume. `per_parameter` (the old
    default, which recipes and the runspec.json of runs submitted before may still name) is read
    as `none`: both are exact, `none` without one collective per parameter."""
    @pydantic.field_validator("comm_hook", mode="before")
    @classmethod
    def _old_default(cls, value: tp.Any) -> tp.Any:
        return "none" if value == "per_parameter" else value

    powersgd_rank: int = pydantic.Field(default=1, ge=1)
    """PowerSGD's matrix approximation rank (with `comm_hook: powersgd`)."""

    def check(self, recipe: Settings, partition: Partition, site: Site) -> None:
        if not partition.gpus_per_node and self.comm_hook == "bf16":
            raise PlanProblem(
                "comm_hook", "the bf16 compression hook needs NCCL (GPUs); use fp16 or powersgd on a CPU partition"
            )

    @classmethod
    def planner_options(cls) -> list[Option]:
        return [REPLICATED]

    def memory_option(self) -> Option:
        return REPLICATED

    def build(
        self,
        model: tp.Any,
        make_optimizer: OptimizerFactory,
        recipe: Settings,
        env: DistEnv,
        run_dir: str | None,
        nvme_dir: str | None,
    ) -> Engine:
        from torch.nn.parallel import DistributedDataParallel

        from hpcrun.runtime.engine import TorchEngine

        model = model.to(env.device)
        ddp = DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
        )
        if self.comm_hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=self.powersgd_rank, start_powerSGD_iter=2
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif self.comm_hook != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.bf16_compress_hook if self.comm_hook == "bf16" else default_hooks.fp16_compress_hook
            ddp.register_comm_hook(None, hook)
        # DDP re-lays its buckets after the first iteration only where it can (torch's Reducer: static graph, or no
        # search for unused parameters); PowerSGD counts iterations, which a throwaway pass would shift
        settle = self.comm_hook != "powersgd" and (self.static_graph or not self.find_unused_parameters)
        return TorchEngine(
            ddp, make_optimizer(ddp.parameters()), recipe, env, model, settle_buckets=settle,
            replicated=self.memory_option().one_snapshot_per_node,
        )
