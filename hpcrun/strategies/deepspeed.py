"""DeepSpeed ZeRO stages 0-3, with optimizer/parameter offload to host memory or node-local
NVMe (ZeRO-Infinity). The engine owns accumulation, clipping, loss scaling and its checkpoints."""

from __future__ import annotations

import dataclasses
import json
import typing as tp
from pathlib import Path

import pydantic

from hpcrun.fields import PathStr
from hpcrun.strategies.base import Option, PlanProblem, Strategy
from hpcrun.strategies.ddp import REPLICATED

if tp.TYPE_CHECKING:
    from hpcrun.runtime.env import DistEnv
    from hpcrun.site import Partition, Site
    from hpcrun.strategies.contract import Engine, OptimizerFactory, Settings

Offload = tp.Literal["none", "cpu", "nvme"]


def library_estimate(
    stage: int, offload: bool, buffer: float = 1.5
) -> tp.Callable[[int, int, int, int], tuple[float, float]]:
    """DeepSpeed's own cold estimators (`estimate_zero2_model_states_mem_needs`,
    `estimate_zero3_model_states_mem_needs` with zero_init), re-stated so a login node need not
    import deepspeed: (host bytes per node, GPU bytes) from (parameters, largest layer, ranks per
    node, nodes). They count fp32 gradient partitions (2+4+4+8 = 18 bytes) and, for ZeRO-3, the
    largest layer's fp32 copy."""

    def estimate(params: int, largest_layer: int, per_node: int, nodes: int) -> tuple[float, float]:
        gpus = per_node * nodes
        if stage == 2:
            return params * 4 * per_node * buffer, 2 * params + int(18 * params / gpus)
        if offload:
            return params * 18 / nodes * buffer, 4 * largest_layer
        # with zero_init only the largest layer passes through host memory
        return largest_layer * 4 * per_node * buffer, 4 * largest_layer + int(18 * params / gpus)

    return estimate


# ZeRO stage 0 lays states out as DDP does; DeepSpeed's own saves stage nothing and it keeps no snapshots
STAGE0 = dataclasses.replace(REPLICATED, stages_checkpoints=False, one_snapshot_per_node=False)
OPTIONS = {
    "zero1": Option("zero1", {"name": "deepspeed", "stage": 1}, "none", False, True, order=1, stages_checkpoints=False),
    "zero2": Option(
        "zero2",
        {"name": "deepspeed", "stage": 2},
        "none",
        True,
        True,
        order=2,
        stages_checkpoints=False,
        library_estimate=library_estimate(2, False),
    ),
    "zero3": Option(
        "zero3",
        {"name": "deepspeed", "stage": 3},
        "all",
        True,
        True,
        order=6,
        stages_checkpoints=False,
        library_estimate=library_estimate(3, False),
    ),
    "zero3-cpu": Option(
        "zero3-cpu",
        {"name": "deepspeed", "stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
        "all",
        True,
        True,
        order=7,
        offload="cpu",
        stages_checkpoints=False,
        library_estimate=library_estimate(3, True),
    ),
    "zero3-nvme": Option(
        "zero3-nvme",
        {"name": "deepspeed", "stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
        "all",
        True,
        True,
        order=8,
        offload="nvme",
        stages_checkpoints=False,
    ),
}


class DeepSpeed(Strategy):
    name: tp.Literal["deepspeed"]
    stage: tp.Literal[0, 1, 2, 3] = 2
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also weights."""
    offload_optimizer: Offload = "none"
    """Where optimizer states live: on the GPU, in host memory, or on node-local NVMe (stage 3)."""
    offload_param: Offload = "none"
    """Where weights live between uses (stage 3 only): GPU, host memory or node-local NVMe."""
    config: PathStr | None = None
    """A DeepSpeed JSON config to use instead of the one these fields imply; its batch sizes are
    set from the recipe so the two never disagree."""

    def resumes_at_another_world_size(self) -> bool:
        """ZeRO-1, -2 and -3 through DeepSpeed's universal checkpoint (DeepSpeedEngine.load), ZeRO-Infinity's
        NVMe too (its swapped partitions converted and loaded by hpcrun.runtime.zeroinfinity). Not stage 0
        (untested here), nor a user's JSON config, whose own stage the recipe's field may not be."""
        return self.stage in (1, 2, 3) and self.config is None

    @pydantic.model_validator(mode="after")
    def _offload_rules(self) -> DeepSpeed:
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"offload_param needs stage 3: only ZeRO-3 partitions parameters (stage is {self.stage})")
        if self.offload_optimizer == "nvme" and self.stage != 3:
            raise ValueError(f"offload_optimizer: nvme needs stage 3 (ZeRO-Infinity) (stage is {self.stage})")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("offload_optimizer needs stage 1, 2 or 3")
        return self

    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_param)

    def check(self, recipe: Settings, partition: Partition, site: Site) -> None:
        if self.uses_nvme() and site.storage.nvme is None:
            field = "offload_param" if self.offload_param == "nvme" else "offload_optimizer"
            raise PlanProblem(field, f"nvme offload needs storage.nvme in site {site.name!r}, which has none")

    @classmethod
    def planner_options(cls) -> list[Option]:
        return list(OPTIONS.values())

    def memory_option(self) -> Option:
        offload = (
            "nvme" if self.uses_nvme() else "cpu" if "cpu" in (self.offload_param, self.offload_optimizer) else None
        )
        if offload and self.stage == 3:
            return OPTIONS[f"zero3-{offload}"]
        return STAGE0 if self.stage == 0 else OPTIONS[f"zero{self.stage}"]

    def result_columns(self) -> dict[str, tp.Any]:
        return {
            "zero_stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
        }

    def engine_config(self, recipe: Settings, nvme_dir: str | None, pin_memory: bool) -> dict[str, tp.Any]:
        """The DeepSpeed config the recipe implies, or the user's JSON with the batch fields set
        from the recipe (so the two never disagree)."""
        training = recipe.training
        if self.config:
            config: dict[str, tp.Any] = json.loads(Path(self.config).read_text())
        else:
            zero: dict[str, tp.Any] = {"stage": self.stage}
            for kind, device in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
                if device != "none":
                    zero[kind] = {"device": device, "pin_memory": pin_memory}
                    if device == "nvme":
                        zero[kind]["nvme_path"] = nvme_dir
            config = {
                "zero_optimization": zero,
                "bf16": {"enabled": recipe.precision == "bf16-mixed"},
                "fp16": {"enabled": recipe.precision == "fp16-mixed"},
                "gradient_clipping": training.grad_clip or 0.0,
                "zero_force_ds_cpu_optimizer": False,
                "steps_per_print": 10**9,
                "wall_clock_breakdown": False,
            }
            if self.uses_nvme():
                config["aio"] = {
                    "block_size": 1048576,
                    "queue_depth": 8,
                    "single_submit": False,
                    "overlap_events": True,
                }
        config["train_micro_batch_size_per_gpu"] = training.micro_batch
        config["gradient_accumulation_steps"] = training.grad_accum
        return config

    def build(
        self,
        model: tp.Any,
        make_optimizer: OptimizerFactory,
        recipe: Settings,
        env: DistEnv,
        run_dir: str | None,
        nvme_dir: str | None,
    ) -> Engine:
        import deepspeed
        import torch
        import torch.distributed as dist

        from hpcrun.rundir import RunDir, write_json
        from hpcrun.runtime import checkpoint
        from hpcrun.runtime.engine import DeepSpeedEngine

        deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
        if nvme_dir:
            Path(nvme_dir).mkdir(parents=True, exist_ok=True)
        config = self.engine_config(recipe, nvme_dir, pin_memory=torch.cuda.is_available())
        config["train_batch_size"] = recipe.training.micro_batch * recipe.training.grad_accum * dist.get_world_size()
        saved = checkpoint.saved_world_size(RunDir(run_dir).checkpoints) if run_dir else None
        if saved not in (None, dist.get_world_size()) and self.resumes_at_another_world_size():  # a shrink
            config["checkpoint"] = {**(config.get("checkpoint") or {}), "load_universal": True}
        if run_dir and env.is_main:  # what DeepSpeed was really given, beside the run's other provenance
            write_json(RunDir(run_dir).deepspeed_config, config)
        engine, _, _, _ = deepspeed.initialize(model=model.to(env.device), optimizer=make_optimizer, config=config)
        return DeepSpeedEngine(engine, recipe.training.grad_accum)
