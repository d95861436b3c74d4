"""DDP, FSDP and DeepSpeed behind one small interface: a micro-step, an optimizer step, and
a save/load of the full training state into a directory."""

from __future__ import annotations

import contextlib
import json
import os
import typing as tp
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager

from hpcrun.recipe import DDP, FSDP, DeepSpeed, Recipe
from hpcrun.runtime import checkpoint
from hpcrun.runtime.env import DistEnv

OptimizerFactory = tp.Callable[[tp.Iterable[nn.Parameter]], torch.optim.Optimizer]

AUTOCAST = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


class Engine(tp.Protocol):
    model: nn.Module
    optimizer: tp.Any

    def micro_step(self, tokens: torch.Tensor, targets: torch.Tensor, last: bool) -> float: ...
    def optimizer_step(self) -> None: ...
    def save(self, directory: Path) -> None: ...
    def load(self, directory: Path) -> None: ...


def block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """Transformer blocks are what sits in a ModuleList; FSDP wraps each one on its own."""
    return {type(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m}


class TorchEngine:
    """DDP or FSDP with torch's own optimizer, autocast and (fp16) loss scaling."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: Recipe, env: DistEnv, raw: nn.Module) -> None:
        self.model, self.optimizer, self.recipe, self.env, self.raw = model, optimizer, recipe, env, raw
        self.dtype = AUTOCAST[recipe.precision]
        self.scaler = torch.amp.GradScaler(env.device.type) if recipe.precision == "fp16-mixed" else None
        self.accum = recipe.training.grad_accum
        self._stager: DefaultStager | None = None

    def micro_step(self, tokens: torch.Tensor, targets: torch.Tensor, last: bool) -> float:
        # skip the gradient all-reduce on all but the last micro-batch of an accumulation
        sync = contextlib.nullcontext() if last or self.accum == 1 else self.model.no_sync()
        cast = torch.autocast(self.env.device.type, dtype=self.dtype) if self.dtype else contextlib.nullcontext()
        with sync:
            with cast:
                loss = self.model(tokens, targets)
            scaled = loss / self.accum
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.item()

    def optimizer_step(self) -> None:
        clip = self.recipe.training.grad_clip
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if clip:
            if hasattr(self.model, "clip_grad_norm_"):  # FSDP: the norm spans every shard
                self.model.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _state(self) -> dict[str, tp.Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, tp.Any] = {"model": model_sd, "optim": optim_sd}
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def save(self, directory: Path) -> None:
        """Sharded with torch.distributed.checkpoint: every rank writes its part, and the result
        loads at another world size."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), storage_writer=checkpoint.DcpWriter(directory))

    def save_async(self, directory: Path, group: tp.Any) -> Future[tp.Any]:
        """`save` with only the copy to host memory on the caller's time; the write runs in a
        background thread whose collectives use `group` (gloo). The future completes on every
        rank once every rank's part is durable and DCP's metadata is written."""
        import torch.distributed.checkpoint as dcp

        if self._stager is None:  # one per engine: its host buffers are reused from save to save
            self._stager = checkpoint.host_stager()
        return dcp.async_save(self._state(), storage_writer=checkpoint.DcpWriter(directory), process_group=group, async_stager=self._stager)  # type: ignore[return-value]

    def load(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.scaler:
            self.scaler.load_state_dict(state["scaler"])


class DeepSpeedEngine:
    """A DeepSpeed engine: it owns accumulation, clipping, loss scaling and its checkpoints."""

    def __init__(self, engine: tp.Any) -> None:
        self.engine = engine
        self.model = engine
        self.optimizer = engine.optimizer

    def micro_step(self, tokens: torch.Tensor, targets: torch.Tensor, last: bool) -> float:
        loss = self.engine(tokens, targets)
        self.engine.backward(loss)
        self.engine.step()  # applies the update only at the accumulation boundary
        return loss.item()

    def optimizer_step(self) -> None:
        """Done inside `micro_step` by the engine itself."""

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag="state")

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag="state")
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}")


def setup(model: nn.Module, make_optimizer: OptimizerFactory, recipe: Recipe, env: DistEnv, nvme_dir: str | None = None) -> Engine:
    """Apply the recipe's strategy to `model` and build its optimizer."""
    strategy = recipe.strategy
    if isinstance(strategy, DeepSpeed):
        return _deepspeed(model, make_optimizer, recipe, strategy, env, nvme_dir)
    if isinstance(strategy, FSDP):
        wrapped = _fsdp(model, recipe, strategy, env)
    else:
        wrapped = _ddp(model.to(env.device), strategy, env)
    return TorchEngine(wrapped, make_optimizer(wrapped.parameters()), recipe, env, model)


def _ddp(model: nn.Module, strategy: DDP, env: DistEnv) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        static_graph=strategy.static_graph,
        gradient_as_bucket_view=strategy.gradient_as_bucket_view,
        find_unused_parameters=strategy.find_unused_parameters,
    )
    if strategy.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if strategy.comm_hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=strategy.powersgd_rank, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            hook = default_hooks.bf16_compress_hook if strategy.comm_hook == "bf16" else default_hooks.fp16_compress_hook
            ddp.register_comm_hook(None, hook)
    return ddp


def _fsdp(model: nn.Module, recipe: Recipe, strategy: FSDP, env: DistEnv) -> nn.Module:
    import functools

    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDPModule
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    sharding = {
        "full": ShardingStrategy.FULL_SHARD,
        "grad_op": ShardingStrategy.SHARD_GRAD_OP,
        "no_shard": ShardingStrategy.NO_SHARD,
        "hybrid": ShardingStrategy.HYBRID_SHARD,
    }[strategy.sharding]
    prefetch = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}[strategy.backward_prefetch]
    dtype = AUTOCAST[recipe.precision]
    mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype) if dtype else None
    param_init = None
    if strategy.meta_init and any(p.is_meta for p in model.parameters()):
        # each wrapped unit is materialised on the device just before it is sharded
        names = {id(m): n for n, m in model.named_modules()}
        init = getattr(model, "init_module", None)
        param_init = functools.partial(_materialise, device=env.device, init=(lambda m: init(names[id(m)], m)) if init else None)
    return FSDPModule(
        model,
        sharding_strategy=sharding,
        auto_wrap_policy=ModuleWrapPolicy(block_classes(model)),
        cpu_offload=CPUOffload(offload_params=True) if strategy.cpu_offload else None,
        backward_prefetch=prefetch,
        mixed_precision=mixed,
        device_id=env.device,
        param_init_fn=param_init,
        use_orig_params=True,
    )


def _materialise(module: nn.Module, device: torch.device, init: tp.Callable[[nn.Module], None] | None) -> None:
    """FSDP calls this for every module still on the meta device; it must set up only that
    module's own parameters: with the model's own `init_module` when it has one (the built-in
    GPT does), else with a leaf layer's default `reset_parameters`."""
    module.to_empty(device=device, recurse=False)
    if init is not None:
        init(module)
    elif callable(getattr(module, "reset_parameters", None)) and not any(True for _ in module.children()):
        module.reset_parameters()


def deepspeed_config(recipe: Recipe, strategy: DeepSpeed, nvme_dir: str | None) -> dict[str, tp.Any]:
    """The DeepSpeed config the recipe implies, or the user's JSON with the batch fields set from
    the recipe (so the two never disagree)."""
    training = recipe.training
    if strategy.config:
        config: dict[str, tp.Any] = json.loads(Path(strategy.config).read_text())
    else:
        zero: dict[str, tp.Any] = {"stage": strategy.stage}
        for kind, device in (("offload_optimizer", strategy.offload_optimizer), ("offload_param", strategy.offload_param)):
            if device != "none":
                zero[kind] = {"device": device, "pin_memory": torch.cuda.is_available()}
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
        if strategy.uses_nvme:
            config["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    config["train_micro_batch_size_per_gpu"] = training.micro_batch
    config["gradient_accumulation_steps"] = training.grad_accum
    return config


def _deepspeed(model: nn.Module, make_optimizer: OptimizerFactory, recipe: Recipe, strategy: DeepSpeed, env: DistEnv, nvme_dir: str | None) -> Engine:
    import deepspeed

    deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
    if nvme_dir:
        Path(nvme_dir).mkdir(parents=True, exist_ok=True)
    config = deepspeed_config(recipe, strategy, nvme_dir)
    config["train_batch_size"] = recipe.training.micro_batch * recipe.training.grad_accum * dist.get_world_size()
    run_dir = os.environ.get("HPCRUN_RUN_DIR")
    if run_dir and env.is_main:  # what DeepSpeed was really given, beside the run's other provenance
        (Path(run_dir) / "deepspeed-config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    engine, _, _, _ = deepspeed.initialize(model=model.to(env.device), optimizer=make_optimizer, config=config)
    return DeepSpeedEngine(engine)
