"""FullyShardedDataParallel: weights, gradients and optimizer states sharded over ranks
(FULL_SHARD is ZeRO-3, SHARD_GRAD_OP ZeRO-2, HYBRID_SHARD ZeRO-3 within a node)."""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

from hpcrun.strategies.base import Option, PlanProblem, Strategy
from hpcrun.strategies.ddp import REPLICATED

if tp.TYPE_CHECKING:
    from torch import device, nn

    from hpcrun.runtime.env import DistEnv
    from hpcrun.site import Partition, Site
    from hpcrun.strategies.contract import Engine, OptimizerFactory, Settings

OPTIONS = {
    "grad_op": Option(
        "fsdp-grad_op", {"name": "fsdp", "sharding": "grad_op"}, "none", True, True, order=3, frees_grads=True
    ),
    "hybrid": Option(
        "fsdp-hybrid", {"name": "fsdp", "sharding": "hybrid"}, "node", True, True, order=4, frees_grads=True
    ),
    "full": Option(
        "fsdp-full", {"name": "fsdp", "sharding": "full"}, "all", True, True, order=5, frees_grads=True
    ),
    # DDP's layout, but every FSDP rank snapshots its own state
    "no_shard": dataclasses.replace(REPLICATED, one_snapshot_per_node=False, frees_grads=True),
}


class FSDP(Strategy):
    name: tp.Literal["fsdp"]
    sharding: tp.Literal["full", "grad_op", "no_shard", "hybrid"] = "full"
    """What is sharded: full (weights, gradients, optimizer), grad_op (gradients and optimizer),
    hybrid (full within a node, replicated across nodes), no_shard (like DDP)."""
    cpu_offload: bool = False
    """Keep parameters in host memory between uses (GPU partitions only)."""
    backward_prefetch: tp.Literal["pre", "post", "none"] = "pre"
    """When the next unit's weights are gathered during backward: overlap against memory."""
    meta_init: bool = False
    """Create the built-in model on the meta device; each unit is materialised just before it is
    sharded, so no rank ever holds the whole model (ignored when starting from a previous stage)."""

    def check(self, recipe: Settings, partition: Partition, site: Site) -> None:
        if not partition.gpus_per_node and self.cpu_offload:
            raise PlanProblem("cpu_offload", "FSDP CPU offload moves parameters off a GPU; this partition has none")

    @classmethod
    def planner_options(cls) -> list[Option]:
        return [OPTIONS["grad_op"], OPTIONS["hybrid"], OPTIONS["full"]]

    def memory_option(self) -> Option:
        return OPTIONS[self.sharding]

    def init_on_meta(self) -> bool:
        return self.meta_init

    def result_columns(self) -> dict[str, tp.Any]:
        offload = "cpu" if self.cpu_offload else "none"
        return {"zero_stage": None, "offload_optimizer": offload, "offload_param": offload}

    def build(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        recipe: Settings,
        env: DistEnv,
        run_dir: str | None,
        nvme_dir: str | None,
    ) -> Engine:
        import torch
        from torch.distributed.fsdp import (
            BackwardPrefetch,
            CPUOffload,
            FullyShardedDataParallel,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from hpcrun.runtime.engine import AUTOCAST, TorchEngine, block_classes

        sharding = {
            "full": ShardingStrategy.FULL_SHARD,
            "grad_op": ShardingStrategy.SHARD_GRAD_OP,
            "no_shard": ShardingStrategy.NO_SHARD,
            "hybrid": ShardingStrategy.HYBRID_SHARD,
        }[self.sharding]
        prefetch = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}[
            self.backward_prefetch
        ]
        dtype = AUTOCAST[recipe.precision]
        mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype) if dtype else None
        param_init = None
        if self.meta_init and any(p.is_meta for p in model.parameters()):
            # each wrapped unit is materialised on the device just before it is sharded
            names = {id(m): n for n, m in model.named_modules()}
            init = getattr(model, "init_module", None)
            param_init = functools.partial(
                _materialise, device=env.device, init=(lambda m: init(names[id(m)], m)) if init else None
            )
        wrapped = FullyShardedDataParallel(
            model,
            sharding_strategy=sharding,
            auto_wrap_policy=ModuleWrapPolicy(block_classes(model)),
            cpu_offload=CPUOffload(offload_params=True) if self.cpu_offload else None,
            backward_prefetch=prefetch,
            mixed_precision=mixed,
            device_id=env.device,
            param_init_fn=param_init,
            use_orig_params=True,
        )
        return TorchEngine(
            wrapped, make_optimizer(wrapped.parameters()), recipe, env, model,
            replicated=self.memory_option().one_snapshot_per_node,
        )


def _materialise(module: nn.Module, device: device, init: tp.Callable[[nn.Module], None] | None) -> None:
    """FSDP calls this for every module still on the meta device; it must set up only that
    module's own parameters: with the model's own `init_module` when it has one (the built-in
    GPT does), else with a leaf layer's default `reset_parameters`."""
    module.to_empty(device=device, recurse=False)
    if init is not None:
        init(module)
    elif callable(getattr(module, "reset_parameters", None)) and not any(True for _ in module.children()):
        tp.cast(tp.Any, module).reset_parameters()
