"""The kinds of job a recipe can run, each a function of the Context: the built-in GPT benchmark,
a user's `module:function`, a user's own command (hpcrun.runtime.command), and a pickled call
submitted through hpcrun's submitit executor (hpcrun.runtime.function)."""

from __future__ import annotations

import importlib
import sys
import typing as tp
from pathlib import Path

import torch

from hpcrun.recipe import EntrypointJob
from hpcrun.runtime.command import run_command
from hpcrun.runtime.context import Context
from hpcrun.runtime.function import run_function
from hpcrun.sizes import GPTSize


def builtin_benchmark(
    ctx: Context, size: GPTSize | None = None, after_step: tp.Callable[[int], None] | None = None
) -> None:
    """The GPT benchmark: synthetic tokens, AdamW, the recipe's strategy and precision. An
    entrypoint may run it with a model `size` of its own and an `after_step` hook (the tests'
    time-bounded jobs pause there)."""
    from hpcrun.runtime.model import GPT, synthetic_batch

    training = ctx.recipe.training
    size = size or ctx.spec.size
    assert size is not None, "a benchmark job's spec always names its model"
    torch.manual_seed(training.seed)
    # meta-device init would discard weights handed over from a previous stage
    meta = ctx.spec.strategy.init_on_meta() and not ctx.spec.init_weights
    with torch.device("meta") if meta else torch.device("cpu"):
        model = GPT(size, training.seq_len, training.activation_checkpointing)
    if training.compile:
        model.compile_blocks()
    engine = ctx.setup(model, lambda params: adamw(params, training.lr))
    mb, accum = training.micro_batch, training.grad_accum
    # this rank's slices of each step's global batch: its own, and after a shrink a lost rank's too, then
    # its padding (the last slice again, weight 0)
    slices = [(m, data_rank) for m in range(accum) for data_rank in ctx.data_ranks]
    micro_steps = len(slices) + ctx.padding
    for step in ctx.steps():
        losses = []
        for i, (m, data_rank) in enumerate(slices):
            first = (m * ctx.data_world + data_rank) * mb
            tokens, targets = synthetic_batch(training.seed, step, first, mb, training.seq_len, size.vocab)
            tokens, targets = tokens.to(ctx.device), targets.to(ctx.device)
            losses.append(engine.micro_step(tokens, targets, last=i == micro_steps - 1))
        for i in range(len(slices), micro_steps):
            engine.micro_step(tokens, targets, last=i == micro_steps - 1, weight=0.0)
        engine.optimizer_step()
        ctx.record_loss(ctx.batch_loss(losses))
        if ctx.env.is_main and (step + 1) % training.log_interval == 0:
            ctx.info(f"step {step + 1}/{training.steps} loss {losses[-1]:.4f}")
        if after_step is not None:
            after_step(step)


def adamw(params: tp.Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The benchmark's AdamW. On CUDA the fused kernel: one launch for the whole update instead of
    a chain of foreach kernels over fp32 weights and moments, and as deterministic. Elsewhere the
    default implementation, whose numbers the CPU runs' exact-resume tests pinned."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused or None)


def user_entrypoint(ctx: Context) -> None:
    job = ctx.recipe.job
    assert isinstance(job, EntrypointJob)
    base = Path(ctx.spec.recipe_path).resolve().parent
    for entry in reversed(job.pythonpath):
        sys.path.insert(0, str((base / entry).resolve()))
    module_name, func_name = job.entrypoint.split(":")
    getattr(importlib.import_module(module_name), func_name)(ctx)


JOBS: dict[str, tp.Callable[[Context], None]] = {
    "benchmark": builtin_benchmark,
    "entrypoint": user_entrypoint,
    "command": run_command,
    "function": run_function,
}
