"""One attempt's results row: what ran where (from the resolved RunSpec), what it measured,
and with which software. The schema it fills is declared in hpcrun.results."""

from __future__ import annotations

import datetime as dt
import hashlib
import sys
import typing as tp

import torch

from hpcrun import __version__
from hpcrun.runtime.context import Context
from hpcrun.runtime.metrics import summarise


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def result_row(ctx: Context, status: str, reason: str | None, peak: int) -> dict[str, tp.Any]:
    spec, recipe = ctx.spec, ctx.recipe
    t = recipe.training
    size = spec.size
    world = spec.world_size  # a torchrun task is a node, not a rank
    # a command job's batch is the script's own: the recipe's training fields say nothing of it
    samples = world * t.micro_batch * t.grad_accum if recipe.job.kind != "command" else None
    measured = summarise(
        ctx.measured, t.warmup_steps, samples * t.seq_len if size and samples else None, samples, world,
        size.flops_per_token(t.seq_len) if size else None, spec.peak_tflops,
    )
    script = ctx.run_dir.script
    ds_version = sys.modules["deepspeed"].__version__ if "deepspeed" in sys.modules else None
    return {
        "run_id": spec.run_id, "sweep_id": spec.sweep_id, "point_id": spec.point_id, "stage": spec.stage,
        "site": spec.site_name, "cluster": spec.cluster, "partition": spec.partition,
        "nodes": spec.nodes, "gpus_per_node": spec.gpus_per_node, "world_size": world,
        "gpu_model": spec.gpu_model, "interconnect": spec.interconnect,
        "strategy": spec.strategy.name, **spec.strategy.result_columns(),
        "precision": recipe.precision, "job_kind": recipe.job.kind, "model": spec.model,
        "parameters": size.parameters(t.seq_len) if size else None,
        "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "global_batch": samples,
        "seq_len": t.seq_len, "steps": t.steps, "seed": t.seed,
        "job_id": ctx.env.job_id, "node_list": ctx.env.node_list, "restart_count": ctx.env.restart_count,
        "start_time": ctx.started, "end_time": dt.datetime.now(dt.timezone.utc), "status": status, "reason": reason,
        "hpcrun_version": __version__, "torch_version": torch.__version__, "deepspeed_version": ds_version,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "git_sha": spec.git_sha, "site_hash": spec.site_hash, "recipe_hash": _hash(recipe.model_dump_json()),
        "script_hash": _hash(script.read_text()) if script.exists() else None,
        "first_step": ctx.start_step, "last_step": ctx.step if not ctx.stopped else ctx.step + 1,
        "peak_memory_bytes": peak, **measured, "slow_ranks": ctx.recorder.slow_ranks() if ctx.recorder else None,
        "extra": dict(ctx.measured.extra),
    }

