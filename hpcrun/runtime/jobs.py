"""The three kinds of job a recipe can run, each a function of the Context: the built-in GPT
benchmark, a user's `module:function`, and a user's own command once per rank."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import torch

from hpcrun.recipe import CommandJob, EntrypointJob
from hpcrun.runtime.context import Context
from hpcrun.sizes import GPTSize


def builtin_benchmark(ctx: Context, size: GPTSize | None = None, after_step: tp.Callable[[int], None] | None = None) -> None:
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
    engine = ctx.setup(model, lambda params: torch.optim.AdamW(params, lr=training.lr, betas=(0.9, 0.95), weight_decay=0.0))
    mb, accum = training.micro_batch, training.grad_accum
    for step in ctx.steps():
        losses = []
        for m in range(accum):
            first = (m * ctx.world_size + ctx.rank) * mb  # this rank's slice of the global batch
            tokens, targets = synthetic_batch(training.seed, step, first, mb, training.seq_len, size.vocab)
            losses.append(engine.micro_step(tokens.to(ctx.device), targets.to(ctx.device), last=m == accum - 1))
        engine.optimizer_step()
        ctx.record_loss(sum(losses) / len(losses))
        if ctx.env.is_main and (step + 1) % training.log_interval == 0:
            ctx.info(f"step {step + 1}/{training.steps} loss {losses[-1]:.4f}")
        if after_step is not None:
            after_step(step)


def user_entrypoint(ctx: Context) -> None:
    job = ctx.recipe.job
    assert isinstance(job, EntrypointJob)
    base = Path(ctx.spec.recipe_path).resolve().parent
    for entry in reversed(job.pythonpath):
        sys.path.insert(0, str((base / entry).resolve()))
    module_name, func_name = job.entrypoint.split(":")
    getattr(importlib.import_module(module_name), func_name)(ctx)


def user_command(ctx: Context) -> None:
    """The user's own script, once per rank, with RANK/WORLD_SIZE/MASTER_* already exported and
    the run's places named (its run and checkpoint directories, its id). The contract: on USR2 or
    SIGTERM (forwarded to the script) save what it needs under HPCRUN_CHECKPOINT_DIR and exit;
    on start, resume from there. A script that exits after a stop signal, whatever its exit code,
    is a stopped attempt that requeues; one that ignores the signal is killed after
    `stop_grace_s(ctx)` and requeued all the same (it resumes from its last own save)."""
    job = ctx.recipe.job
    assert isinstance(job, CommandJob)
    env = {**os.environ, "HPCRUN_RUN_DIR": str(ctx.run_dir.path), "HPCRUN_RUN_ID": ctx.spec.run_id, "HPCRUN_CHECKPOINT_DIR": str(ctx.checkpoints.root)}
    cwd = Path(ctx.spec.recipe_path).resolve().parent / job.workdir if job.workdir else None
    ctx.flag.child = child = subprocess.Popen(job.command, env=env, cwd=cwd)
    code = wait_stoppable(child, ctx)
    if ctx.flag.signum is not None:
        ctx.stopped = signal.Signals(ctx.flag.signum).name
        ctx.info(f"{ctx.stopped}: command exited with status {code} after the stop signal, stopping for requeue")
        return
    if code != 0:
        raise RuntimeError(f"command {job.command[0]!r} exited with status {code} on rank {ctx.rank}")


# The most a user script gets to exit after a stop signal: well below the shortest KillWait hpcrun
# runs under (20 s: the test cluster's and the local controller's; SLURM's default is 30 s), so
# that after a kill the rank still has time to write its row and requeue before SIGKILL.
STOP_GRACE_MAX_S = 12.0


def stop_grace_s(ctx: Context) -> float:
    """How long a script may take to save and exit after a stop signal: half the lead SLURM
    gives before the time limit, and at most STOP_GRACE_MAX_S, since on preemption only
    KillWait separates SIGTERM from SIGKILL."""
    return max(1.0, min(STOP_GRACE_MAX_S, ctx.spec.signal_lead_s / 2))


def wait_stoppable(child: subprocess.Popen[bytes], ctx: Context) -> int:
    """The script's exit status; after a stop signal it gets `stop_grace_s` to exit, then is
    killed (its exit is then a stop like any other)."""
    deadline: float | None = None
    while True:
        try:
            return child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if ctx.flag.signum is not None and deadline is None:
            deadline = time.monotonic() + stop_grace_s(ctx)
        if deadline is not None and time.monotonic() > deadline:
            ctx.info(f"command still running {stop_grace_s(ctx):.0f} s after the stop signal: killed")
            child.kill()


JOBS: dict[str, tp.Callable[[Context], None]] = {"benchmark": builtin_benchmark, "entrypoint": user_entrypoint, "command": user_command}
